"""/v1/completions logprobs as vLLM answers them (issue 19, item 3): top_logprobs always names the chosen
token (logprobs: 0 included), echoed prompt positions carry their own token, and prompt scoring
(echo, max_tokens 0, logprobs N) returns the prompt's logprobs and no completion."""

from __future__ import annotations

import math

import openai
import pytest
from gw_helpers import http, sse_events, wait_kv_full

MODEL = "llama"
PROMPT = "The quick brown fox jumps over"


def _check_top_names_chosen(lp, start: int = 0) -> None:
    for token, chosen, top in zip(lp.tokens[start:], lp.token_logprobs[start:], lp.top_logprobs[start:]):
        assert token in top, (token, top)
        if token != "\ufffd":  # byte tokens all read U+FFFD: one key for several ids, as in vLLM
            assert math.isclose(top[token], chosen, abs_tol=1e-5), (token, chosen, top)


def test_logprobs_zero_returns_the_chosen_token(oai):
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0,
                               extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(len(top) == 1 for top in lp.top_logprobs)
    _check_top_names_chosen(lp)


def test_sampled_token_outside_the_top_n_is_listed_too(oai):
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.5, seed=7, logprobs=1,
                               extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    _check_top_names_chosen(lp)
    sizes = {len(top) for top in lp.top_logprobs}
    assert sizes <= {1, 2} and 2 in sizes  # at temperature 1.5 some sampled tokens were not the top 1


def test_echo_prompt_positions_carry_their_token(oai, gw_engine):
    n_prompt = len(gw_engine.tokenizer.encode(PROMPT))
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=2,
                               extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    _check_top_names_chosen(lp, start=1)
    assert all(len(top) >= 2 for top in lp.top_logprobs[n_prompt:])  # generated: the top 2 (+ chosen)


@pytest.mark.parametrize("n", [1, 2])
def test_prompt_scoring(oai, gw_engine, n):
    ids = gw_engine.tokenizer.encode(PROMPT)
    with_output = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                         logprobs=1, extra_body={"ignore_eos": True})
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, n=n)
    assert len(r.choices) == n
    for c in r.choices:
        assert c.text == PROMPT and c.finish_reason == "length"
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == PROMPT
        assert lp.token_logprobs[0] is None and lp.text_offset[0] == 0
        expected = with_output.choices[0].logprobs.token_logprobs[1:len(ids)]
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lp.token_logprobs[1:], expected))
        _check_top_names_chosen(lp, start=1)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    wait_kv_full(gw_engine)


def test_prompt_scoring_streams_one_chunk_and_token_prompts(gw_url, gw_engine):
    ids = gw_engine.tokenizer.encode(PROMPT)
    status, raw = http(gw_url + "/v1/completions", "POST", {
        "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200
    events = [e for e in sse_events(raw) if e != "[DONE]"]
    [chunk] = [e for e in events if e["choices"]]
    choice = chunk["choices"][0]
    assert choice["text"] == gw_engine.tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert events[-1]["usage"]["completion_tokens"] == 0
    _, plain = http(gw_url + "/v1/completions", "POST", {"prompt": PROMPT, "max_tokens": 0, "echo": True})
    assert plain["choices"][0]["text"] == PROMPT and plain["choices"][0]["logprobs"] is None


def test_max_tokens_zero_without_echo_is_still_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=1)
    assert e.value.body["param"] == "max_tokens"
