"""Stop rules (stop strings, stop ids, EOS, max_new_tokens, min_new_tokens), seeded sampling and
logprobs, end to end through the in-process Engine. Stop strings and ids are taken from the model's
own greedy output, so each test knows exactly where generation must end."""

from __future__ import annotations

import random

import pytest

from runtime import Engine
from runtime.text.tokenizer import Tokenizer

EOS = 2  # <|im_end|> in the tiny tokenizer
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
PROMPTS = ["The capital of Italy is", "The lazy dog", "I am fine, thank you.", "Hello world! How are you",
           "The quick brown fox", "Numbers: 0 1 2 3"]


def first_completing(tok: Tokenizer, ids: list[int], stop: str) -> int | None:
    """Index of the output token whose text first completes `stop`."""
    return next((j for j in range(len(ids)) if stop in tok.decode(ids[:j + 1])), None)


def word_stop(tok: Tokenizer, ids: list[int]) -> tuple[str, int] | None:
    """A stop string that is one whole ASCII token of the output (not before token 2), and its index."""
    for k in range(2, len(ids)):
        piece = tok.decode([ids[k]])
        if len(piece) >= 2 and piece.isascii() and piece.isalnum() and first_completing(tok, ids, piece) == k:
            return piece, k
    return None


def spanning_stop(tok: Tokenizer, ids: list[int]) -> tuple[str, int] | None:
    """A two-character stop string whose first character ends token k-1 and whose second starts token k."""
    for k in range(2, len(ids)):
        a, b = tok.decode(ids[:k]), tok.decode(ids[:k + 1])
        if len(b) <= len(a) or not b.startswith(a):
            continue
        stop = a[-1] + b[len(a)]
        if stop.isascii() and stop.isalnum() and stop not in a:
            return stop, k
    return None


def find_case(engine: Engine, pick) -> tuple[str, list[int], str, int]:
    for prompt in PROMPTS:
        ids = engine.generate(prompt, GREEDY)["output_ids"]
        found = pick(engine.tokenizer, ids)
        if found is not None:
            return prompt, ids, *found
    pytest.fail("no prompt's greedy output has a usable stop string")


@pytest.mark.parametrize("pick", [word_stop, spanning_stop], ids=["in-one-token", "across-two-tokens"])
def test_stop_string_ends_and_is_not_shown(engine, pick):
    tok = engine.tokenizer
    prompt, ids, stop, k = find_case(engine, pick)
    full = tok.decode(ids[:k + 1])
    out = engine.generate(prompt, {**GREEDY, "stop": ["never-in-this-text", stop]})
    assert out["finish_reason"] == "stop"
    assert out["matched_stop"] == stop
    assert out["output_ids"] == ids[:k + 1]  # generation stopped at the token that completed it
    assert out["text"] == full[:full.index(stop)]
    assert stop not in out["text"]
    # Streaming shows the same text: the partial stop string was held back, then dropped.
    assert "".join(d["text"] for d in _stream(engine, prompt, {**GREEDY, "stop": stop})) == out["text"]


def test_min_new_tokens_lets_an_earlier_stop_string_through(engine):
    tok = engine.tokenizer
    prompt, _, stop, k = find_case(engine, word_stop)
    m = k + 2  # the stop string is complete at token k, before min_new_tokens
    params = {**GREEDY, "min_new_tokens": m}
    ref = engine.generate(prompt, params)["output_ids"]  # same bans (EOS until m), no stop string
    floor = len(tok.decode(ref[:m - 1]))
    later = next((j for j in range(m - 1, len(ref))
                  if tok.decode(ref[:j + 1]).find(stop, max(0, floor - len(stop) + 1)) != -1), None)
    out = engine.generate(prompt, {**params, "stop": [stop]})
    assert stop in out["text"]  # the early occurrence is plain text
    if later is None:
        assert out["finish_reason"] == "length" and out["output_ids"] == ref
        assert out["text"] == tok.decode(ref)
    else:
        full = tok.decode(ref[:later + 1])
        assert out["finish_reason"] == "stop" and out["output_ids"] == ref[:later + 1]
        assert out["text"] == full[:full.index(stop, max(0, floor - len(stop) + 1))]
    assert "".join(d["text"] for d in _stream(engine, prompt, {**params, "stop": [stop]})) == out["text"]


def _stream(engine: Engine, prompt: str, params: dict) -> list[dict]:
    import asyncio

    async def run() -> list[dict]:
        return [d async for d in engine.async_generate(prompt, params, stream=True)]

    return asyncio.run(run())


def test_stop_token_ids_and_min_new_tokens(engine):
    ids = engine.generate(PROMPTS[0], GREEDY)["output_ids"]
    t = ids[4]
    first = ids.index(t)
    out = engine.generate(PROMPTS[0], {**GREEDY, "stop_token_ids": [t]})
    assert out["finish_reason"] == "stop" and out["matched_stop"] == t
    assert out["output_ids"] == ids[:first + 1]

    # min_new_tokens bans the stop id until that many tokens exist: the model picks something else there.
    min_new = first + 3
    blocked = engine.generate(PROMPTS[0], {**GREEDY, "stop_token_ids": [t], "min_new_tokens": min_new})
    got = blocked["output_ids"]
    assert got[:first] == ids[:first]
    assert t not in got[:min_new]
    assert len(got) >= min_new
    if blocked["finish_reason"] == "stop":
        assert got[-1] == t and len(got) > min_new
    else:
        assert blocked["finish_reason"] == "length" and len(got) == GREEDY["max_new_tokens"]


def test_max_new_tokens_finishes_with_length(engine):
    for n in (1, 2, 7):
        out = engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": n})
        assert out["finish_reason"] == "length" and out["matched_stop"] is None
        assert len(out["output_ids"]) == n and out["usage"]["completion_tokens"] == n


@pytest.fixture(scope="module")
def eos_case(shared_engine: Engine) -> tuple[list[int], list[int], int]:
    """A prompt whose greedy continuation reaches EOS (at index >= 2), found among random prompts."""
    rng = random.Random(0)
    for _ in range(4):
        prompts = [[rng.randint(3, 399) for _ in range(rng.randint(3, 20))] for _ in range(100)]
        outs = shared_engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 30})
        for p, o in zip(prompts, outs):
            ids = o["output_ids"]
            if EOS in ids[2:] and EOS not in ids[:2]:
                return p, ids, ids.index(EOS)
    pytest.fail("no random prompt reached EOS greedily")


def test_eos_ends_unless_ignored(engine, eos_case):
    prompt, ids, e = eos_case
    out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 30})
    assert out["finish_reason"] == "stop" and out["matched_stop"] == EOS
    assert out["output_ids"] == ids[:e + 1]
    assert "<|im_end|>" not in out["text"]  # special tokens are skipped in the text
    assert out["text"] == engine.tokenizer.decode(ids[:e])

    ignored = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 30})
    assert ignored["finish_reason"] == "length" and ignored["output_ids"] == ids

    min_new = e + 2
    blocked = engine.generate(input_ids=prompt, sampling_params={
        "temperature": 0, "max_new_tokens": 30, "min_new_tokens": min_new})
    got = blocked["output_ids"]
    assert got[:e] == ids[:e] and EOS not in got[:min_new] and len(got) >= min_new


def test_seeded_sampling_is_batch_invariant(engine):
    params = {"temperature": 0.8, "seed": 1234, "max_new_tokens": 16, "ignore_eos": True}
    alone = engine.generate(PROMPTS[2], params)["output_ids"]
    batch = engine.generate([PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[2]], [
        {**params, "seed": 7}, params, GREEDY, {**params, "temperature": 1.3, "seed": 99}])
    assert batch[1]["output_ids"] == alone
    assert engine.generate(PROMPTS[2], params)["output_ids"] == alone  # and again, later
    other = engine.generate(PROMPTS[2], {**params, "seed": 1235})["output_ids"]
    assert other != alone
    greedy = engine.generate(PROMPTS[2], {**GREEDY, "max_new_tokens": 16})["output_ids"]
    assert alone != greedy  # temperature 0.8 really sampled


def test_logprobs_match_hf_log_softmax(engine, hf_logprobs):
    prompt = engine.tokenizer.encode(PROMPTS[0])
    out = engine.generate(input_ids=prompt, sampling_params={
        **GREEDY, "max_new_tokens": 10, "return_logprob": True, "top_logprobs_num": 3})
    ids, lps, tops = out["output_ids"], out["logprobs"], out["top_logprobs"]
    assert len(lps) == len(tops) == len(ids) == 10
    ref = hf_logprobs(prompt, ids)
    for i, t in enumerate(ids):
        assert lps[i] == pytest.approx(float(ref[i, t]), abs=1e-4)
        assert [tid for tid, _ in tops[i]] == ref[i].topk(3).indices.tolist()
        assert tops[i][0][0] == t  # greedy picked the most likely token
        for tid, lp in tops[i]:
            assert lp == pytest.approx(float(ref[i, tid]), abs=1e-4)
    plain = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 10})
    assert "logprobs" not in plain and plain["output_ids"] == ids


@pytest.mark.parametrize("chunk", [-1, 8])
def test_input_logprobs_match_hf(make_engine, tiny_llama, hf_llama, chunk: int):
    import torch

    engine = make_engine(tiny_llama, chunked_prefill_size=chunk)
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    engine.generate(input_ids=prompt, sampling_params=GREEDY)  # cached now: input logprobs must not use it
    out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 3},
                          return_input_logprob=True)
    got = out["input_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf_llama(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for i in range(1, len(prompt)):
        assert got[i] == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
    assert out["usage"]["cached_tokens"] == 0


IM_START = 1  # <|im_start|>: a special token that is not EOS


@pytest.mark.parametrize(("stop", "min_new", "n_out", "text"), [
    ("<|im_start|>", 2, 2, "<|im_start|>"),  # the first one is before min_new_tokens: plain text
    ("|><|", 0, 2, "<|im_start"),
], ids=["whole-token", "across-two-special-tokens"])
def test_stop_string_of_special_token_text_honours_skip_special_tokens(engine, stop, min_new, n_out, text):
    """The scheduler's stop check decodes as the request asks: with skip_special_tokens false a stop string
    made of special-token text ends the request in the engine; with it true that text does not exist."""
    params = {"temperature": 0, "max_new_tokens": 12, "logit_bias": {IM_START: 100.0}, "stop": [stop],
              "min_new_tokens": min_new}
    kept = engine.generate("Hello", {**params, "skip_special_tokens": False})
    assert kept["output_ids"] == [IM_START] * n_out
    assert kept["finish_reason"] == "stop" and kept["matched_stop"] == stop
    assert kept["text"] == text
    skipped = engine.generate("Hello", {**params, "skip_special_tokens": True})
    assert skipped["output_ids"] == [IM_START] * 12
    assert skipped["finish_reason"] == "length" and skipped["text"] == ""
