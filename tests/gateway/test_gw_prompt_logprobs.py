"""vLLM's prompt_logprobs over HTTP, against HF transformers' fp32 log_softmax over the same tiny Llama:
per choice on /v1/completions, on the response on /v1/chat/completions; each position after the first a
dict keyed by token id (a string) of {logprob, rank, decoded_token}, the prompt token first, then the top
N. A prompt in the prefix cache is still scored whole; the n choices of a prompt share one scoring; echo
with logprobs lists them too (vLLM's default); a stream refuses N > 0; bad values are 400s naming it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gw_helpers import http, sse_events

PROMPT = "The quick brown fox jumps over the lazy dog"
USER = [{"role": "user", "content": "Hello world!"}]
GREEDY = {"temperature": 0, "max_tokens": 2, "ignore_eos": True}


def _post(url: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    status, r = http(url + route, "POST", {**GREEDY, **body})
    assert status == 200, r
    return r


def assert_vllm_shape_and_hf(plp: list, ids: list[int], ref: torch.Tensor, k: int, tokenizer) -> None:
    """vLLM's shape, and each number as HF computes it: the prompt token's logprob and its rank in the
    whole distribution (within the fp32 tolerance), the top k ids and their ranks 1..k."""
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        row, entry, tok = ref[i - 1], plp[i], ids[i]
        assert list(entry)[0] == str(tok)  # the prompt token first
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {str(t) for t in top} | {str(tok)}
        for key, v in entry.items():
            assert set(v) == {"logprob", "rank", "decoded_token"}
            assert v["decoded_token"] == tokenizer.id_to_token_text(int(key))
            assert v["logprob"] == pytest.approx(float(row[int(key)]), abs=1e-4)
        for rank, t in enumerate(top, start=1):
            assert entry[str(t)]["rank"] == rank
        lp = float(row[tok])
        lo, hi = int((row > lp + 1e-4).sum()) + 1, int((row >= lp - 1e-4).sum())
        assert lo <= entry[str(tok)]["rank"] <= hi, (i, entry[str(tok)], lo, hi)


def test_completions_match_hf_with_the_prompt_cached(gw_url, gw_engine, hf_rows):
    ids = gw_engine.tokenizer.encode(PROMPT)
    _post(gw_url, "/v1/completions", {"prompt": PROMPT})
    cached = _post(gw_url, "/v1/completions", {"prompt": PROMPT})
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the cache holds the prompt
    assert "prompt_logprobs" not in cached["choices"][0]  # not asked, not there
    r = _post(gw_url, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 3})
    [c] = r["choices"]
    assert c["text"] == cached["choices"][0]["text"] and c["logprobs"] is None
    assert_vllm_shape_and_hf(c["prompt_logprobs"], ids, hf_rows(ids), 3, gw_engine.tokenizer)


def test_completions_n_choices_and_prompts_each_get_their_own(gw_url, gw_engine, hf_rows):
    prompts = [PROMPT, "Hello world! How are you"]
    r = _post(gw_url, "/v1/completions", {"prompt": prompts, "n": 2, "prompt_logprobs": 0, "temperature": 1.0,
                                          "seed": 5})
    assert len(r["choices"]) == 4
    for c in r["choices"]:
        ids = gw_engine.tokenizer.encode(prompts[c["index"] // 2])
        assert all(e is None or len(e) == 1 for e in c["prompt_logprobs"])  # 0: the prompt token alone
        assert_vllm_shape_and_hf(c["prompt_logprobs"], ids, hf_rows(ids), 0, gw_engine.tokenizer)
    assert r["choices"][0]["prompt_logprobs"] == r["choices"][1]["prompt_logprobs"]


def test_echo_with_logprobs_lists_them_too(gw_url, gw_engine, hf_rows):
    ids = gw_engine.tokenizer.encode(PROMPT)
    ref = hf_rows(ids)
    r = _post(gw_url, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 2})
    c = r["choices"][0]
    assert_vllm_shape_and_hf(c["prompt_logprobs"], ids, ref, 2, gw_engine.tokenizer)
    # Asked both ways: echo keeps its own top N, prompt_logprobs its.
    r = _post(gw_url, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1, "prompt_logprobs": 4})
    c = r["choices"][0]
    assert all(len(t) <= 2 for t in c["logprobs"]["top_logprobs"][1:])
    assert_vllm_shape_and_hf(c["prompt_logprobs"], ids, ref, 4, gw_engine.tokenizer)
    # Prompt scoring (echo, max_tokens 0) too.
    r = _post(gw_url, "/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1})
    assert_vllm_shape_and_hf(r["choices"][0]["prompt_logprobs"], ids, ref, 1, gw_engine.tokenizer)


def test_chat_puts_them_on_the_response(gw_url, gw_engine, hf_rows):
    ids = gw_engine.tokenizer.apply_chat_template(USER)
    r = _post(gw_url, "/v1/chat/completions", {"messages": USER, "n": 2, "prompt_logprobs": 2})
    assert len(r["choices"]) == 2 and all("prompt_logprobs" not in c for c in r["choices"])
    assert_vllm_shape_and_hf(r["prompt_logprobs"], ids, hf_rows(ids), 2, gw_engine.tokenizer)
    plain = _post(gw_url, "/v1/chat/completions", {"messages": USER})
    assert "prompt_logprobs" not in plain
    assert plain["choices"][0]["message"] == r["choices"][0]["message"]


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": PROMPT}),
                                         ("/v1/chat/completions", {"messages": USER})])
def test_stream(gw_url, route, body):
    status, err = http(gw_url + route, "POST", {**GREEDY, **body, "stream": True, "prompt_logprobs": 2})
    assert status == 400 and err["error"]["param"] == "prompt_logprobs", err
    assert "stream" in err["error"]["message"]
    # 0 asks for nothing a stream could carry: accepted, as vLLM does, and the chunks are as ever.
    status, raw = http(gw_url + route, "POST", {**GREEDY, **body, "stream": True, "prompt_logprobs": 0})
    assert status == 200 and raw.endswith("data: [DONE]\n\n")
    assert all("prompt_logprobs" not in str(e) for e in sse_events(raw))


@pytest.mark.parametrize("value", [-1, -2, 21, "2", 1.5])
@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": PROMPT}),
                                         ("/v1/chat/completions", {"messages": USER})])
def test_bad_values_are_400s(gw_url, route, body, value):
    status, err = http(gw_url + route, "POST", {**GREEDY, **body, "prompt_logprobs": value})
    assert status == 400 and err["error"]["param"] == "prompt_logprobs", err
    if isinstance(value, int) and value == -1:
        assert "whole vocabulary" in err["error"]["message"]
