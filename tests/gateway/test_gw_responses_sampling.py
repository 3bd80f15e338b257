"""vLLM's sampling extras on POST /v1/responses, as chat and completions take them: allowed_token_ids (a
stream emits only those ids, the ones the Engine gives with the same constraint) and bad_words (the
gateway tokenizes them; the answer is the Engine's with the same ban); bad values are the same 400s
naming the field, and prompt_logprobs, which a Response has no place for, is a 400 too."""

from __future__ import annotations

from typing import Any

import pytest
from gw_helpers import http

MODEL = "llama"
INPUT = [{"role": "user", "content": "Hello world!"}]
LOGPROBS = ["message.output_text.logprobs"]


def engine_ids(gw_engine: Any, input_ids: list[int], **params: Any) -> list[int]:
    return gw_engine.generate(input_ids=input_ids, sampling_params={
        "temperature": 0, "ignore_eos": True, "max_new_tokens": 8, **params})["output_ids"]


def test_allowed_token_ids_stream_only_those_ids(oai, gw_engine):
    tok = gw_engine.tokenizer
    prompt = tok.apply_chat_template(INPUT)
    free = engine_ids(gw_engine, prompt)
    allowed = sorted({*free[1:4], 40, 41} - {free[0]})
    want = engine_ids(gw_engine, prompt, allowed_token_ids=allowed)
    assert set(want) <= set(allowed) and want != free
    events = list(oai.responses.create(model=MODEL, input=INPUT, max_output_tokens=8, temperature=0, stream=True,
                                       include=LOGPROBS, extra_body={"ignore_eos": True,
                                                                     "allowed_token_ids": allowed}))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    by_bytes = {tok.id_to_token_bytes(i): i for i in range(tok.vocab_size)}  # the tiny BPE spells each apart
    assert [by_bytes[bytes(lp.bytes)] for e in deltas for lp in e.logprobs] == want
    assert "".join(e.delta for e in deltas) == events[-1].response.output_text == tok.decode(want)


def test_bad_words_are_never_generated(oai, gw_engine):
    tok = gw_engine.tokenizer
    prompt = tok.apply_chat_template(INPUT)
    free = engine_ids(gw_engine, prompt)
    # A word of the free answer whose text tokenizes back to its ids, so the string bans what it names.
    word = next(tok.decode(free[i:i + 2]) for i in range(len(free) - 1)
                if tok.encode(tok.decode(free[i:i + 2]).lstrip(), add_special_tokens=False) == free[i:i + 2])
    want = engine_ids(gw_engine, prompt, bad_words=[word])
    assert want != free and word not in tok.decode(want)
    r = oai.responses.create(model=MODEL, input=INPUT, max_output_tokens=8, temperature=0,
                             extra_body={"ignore_eos": True, "bad_words": [word]})
    assert r.output_text == tok.decode(want)


@pytest.mark.parametrize(("extra", "param"), [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [5, 10**6]}, "allowed_token_ids"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["x"] * 129}, "bad_words"),
    ({"bad_words": [f"w{i} z{i}" for i in range(100)]}, "bad_words"),  # over 128 sequences once tokenized
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
])
def test_bad_values_are_400s_naming_the_field(gw_url, extra, param):
    status, r = http(gw_url + "/v1/responses", "POST", {"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                                        **extra})
    assert status == 400, r
    assert r["error"]["param"] == param and r["error"]["message"], r


def test_null_prompt_logprobs_asks_for_nothing(gw_url):
    status, r = http(gw_url + "/v1/responses", "POST", {"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                                        "prompt_logprobs": None})
    assert status == 200 and r["status"] == "incomplete", r
