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


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_echo_prompt_positions_list_their_top_n(oai, gw_engine, max_tokens):
    """echo + logprobs N: each prompt position after the first holds its top N (the engine's, which
    tests/managers checks against HF) plus its own token when that is not among them."""
    tok = gw_engine.tokenizer
    ids = tok.encode(PROMPT)
    ref = gw_engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 1},
                             input_top_logprobs_num=3)
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, echo=True,
                               logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + max_tokens and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        expected = {tok.id_to_token_text(t): v for t, v in ref["input_top_logprobs"][i]}
        expected.setdefault(tok.id_to_token_text(ids[i]), ref["input_logprobs"][i])
        top = lp.top_logprobs[i]
        assert top.keys() == expected.keys(), (i, top, expected)  # byte tokens share the key U+FFFD
        assert all(math.isclose(top[k], expected[k], abs_tol=1e-5) for k in top)
    _check_top_names_chosen(lp, start=1)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs[len(ids):])
    wait_kv_full(gw_engine)


def test_streamed_echo_sends_prompt_top_n_first(gw_url, gw_engine):
    ids = gw_engine.tokenizer.encode(PROMPT)
    status, raw = http(gw_url + "/v1/completions", "POST", {
        "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2, "stream": True,
        "ignore_eos": True})
    assert status == 200
    chunks = [e["choices"][0] for e in sse_events(raw) if e != "[DONE]" and e["choices"]]
    first = chunks[0]["logprobs"]
    assert first["top_logprobs"][0] is None
    assert all(1 <= len(top) <= 3 for top in first["top_logprobs"][1:len(ids)])
    assert max(len(top) for top in first["top_logprobs"][1:len(ids)]) >= 2  # the top 2, not only the chosen
    tops = [t for c in chunks for t in c["logprobs"]["top_logprobs"]]
    assert len(tops) == len(ids) + 3
    wait_kv_full(gw_engine)


def test_prompt_scoring_is_length_even_when_its_hidden_token_is_eos(oai, gw_engine):
    """max_tokens 0 gets 0 tokens: finish_reason length (vLLM's), whatever the one hidden token the engine
    makes is, with no matched_stop; forced to EOS here (an unseeded draw once landed on it and said stop)."""
    eos = sorted(gw_engine.tokenizer.eos_token_ids)[0]
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                               logit_bias={str(eos): 100})
    assert r.choices[0].text == PROMPT and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0
    assert r.choices[0].model_extra.get("matched_stop") is None  # nothing was matched: no stop reported
