"""vLLM's allowed_token_ids and bad_words over HTTP: /v1/completions and /v1/chat/completions (streamed
too) give what the Engine gives with the same constraint, and /generate takes bad_words in its
sampling_params; bad values are 400s naming the field, and so is a grammar (response_format) that no allowed
id satisfies: the request ends with that error (the usual error event in a stream) and frees its KV."""

from __future__ import annotations

import pytest
from gw_helpers import generation_error, http, sse_events, wait_kv_full

MODEL = "llama"
MESSAGES = [{"role": "user", "content": "Hello world!"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


def engine_ids(gw_engine, input_ids: list[int], **params) -> list[int]:
    return gw_engine.generate(input_ids=input_ids, sampling_params={**GREEDY, "max_new_tokens": 8,
                                                                   **params})["output_ids"]


def contains(output: list[int], word: list[int]) -> bool:
    return any(output[i:i + len(word)] == word for i in range(len(output) - len(word) + 1))


def test_completions_allowed_token_ids(gw_url, gw_engine):
    prompt = gw_engine.tokenizer.encode("The quick brown")
    free = engine_ids(gw_engine, prompt)
    allowed = sorted({*free[1:4], 40, 41} - {free[0]})
    want = engine_ids(gw_engine, prompt, allowed_token_ids=allowed)
    assert set(want) <= set(allowed) and want != free
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, **GREEDY, "allowed_token_ids": allowed}
    status, r = http(gw_url + "/v1/completions", "POST", body)
    assert status == 200, r
    assert r["choices"][0]["text"] == gw_engine.tokenizer.decode(want)
    status, raw = http(gw_url + "/v1/completions", "POST", {**body, "stream": True})
    assert status == 200
    assert "".join(e["choices"][0]["text"] for e in sse_events(raw) if e != "[DONE]" and e["choices"]) \
        == gw_engine.tokenizer.decode(want)


def test_chat_bad_words(gw_url, gw_engine):
    ids = gw_engine.tokenizer.apply_chat_template(MESSAGES)
    free = engine_ids(gw_engine, ids)
    tok = gw_engine.tokenizer
    # A word of the free answer whose text tokenizes back to its ids, so the string bans what it names.
    word = next(tok.decode(free[i:i + 2]) for i in range(len(free) - 1)
                if tok.encode(tok.decode(free[i:i + 2]).lstrip(), add_special_tokens=False) == free[i:i + 2])
    want = engine_ids(gw_engine, ids, bad_words=[word])
    assert want != free and word not in tok.decode(want)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, **GREEDY, "bad_words": [word]}
    status, r = http(gw_url + "/v1/chat/completions", "POST", body)
    assert status == 200, r
    assert r["choices"][0]["message"]["content"] == tok.decode(want)
    status, r = http(gw_url + "/generate", "POST", {"input_ids": ids, "sampling_params": {
        **GREEDY, "max_new_tokens": 8, "bad_words": [word]}})
    assert status == 200 and r["output_ids"] == want, r


def test_chat_allowed_token_ids_with_logprobs_stays_raw(gw_url, gw_engine):
    ids = gw_engine.tokenizer.apply_chat_template(MESSAGES)
    lp1 = {"max_new_tokens": 1, "return_logprob": True}
    free = gw_engine.generate(input_ids=ids, sampling_params={**GREEDY, **lp1})
    other = (free["output_ids"][0] + 7) % 400
    kept = gw_engine.generate(input_ids=ids, sampling_params={**GREEDY, **lp1, "allowed_token_ids": [other]})
    assert kept["output_ids"] == [other]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **GREEDY, "allowed_token_ids": [other],
            "logprobs": True, "top_logprobs": 1}
    status, r = http(gw_url + "/v1/chat/completions", "POST", body)
    assert status == 200, r
    lp = r["choices"][0]["logprobs"]["content"][0]
    assert lp["logprob"] == pytest.approx(kept["logprobs"][0], abs=1e-5)
    # The raw distribution's top is the free choice, which the constraint kept out of the answer.
    top = lp["top_logprobs"][0]["logprob"]
    assert top == pytest.approx(free["logprobs"][0], abs=1e-5) and top > lp["logprob"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("extra", "param"), [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [5, 10**6]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["x"] * 129}, "bad_words"),
    ({"bad_words": [f"w{i} z{i}" for i in range(100)]}, "bad_words"),  # over 128 sequences once tokenized
])
def test_bad_values_are_400s_naming_the_field(gw_url, route, extra, param):
    body = {"model": MODEL, "max_tokens": 2, **extra}
    body.update({"prompt": "hi"} if route == "/v1/completions" else {"messages": MESSAGES})
    status, r = http(gw_url + route, "POST", body)
    assert status == 400, r
    assert r["error"]["param"] == param, r


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_no_allowed_id_satisfies_is_a_400_naming_the_field(gw_url, gw_engine, stream):
    pytest.importorskip("xgrammar")
    # JSON must open with "{" (or whitespace): token 5 alone can never start it.
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "allowed_token_ids": [5],
            "response_format": {"type": "json_object"}, "stream": stream}
    err = generation_error(gw_url + "/v1/completions", body)
    assert err["param"] == "allowed_token_ids" and err["type"] == "invalid_request_error", err
    assert "no token satisfies the structured output's grammar together with allowed_token_ids" in err["message"]
    wait_kv_full(gw_engine)
