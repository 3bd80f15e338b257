"""The Engine on CPU with FP8 KV and FP8 weights: chunked prefill, MIXED steps and radix-cache hits all run
over the FP8 pool; every request finishes with its tokens, agrees with the full-precision engine on most
greedy tokens, and leaves the KV pool whole."""

from __future__ import annotations

import random

import pytest

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randint(3, 399) for _ in range(40)]  # a common prefix, so later requests hit the cache
    return [shared + [rng.randint(3, 399) for _ in range(rng.randint(5, 30))] for _ in range(6)]


@pytest.mark.parametrize("extra", [{"kv_cache_dtype": "fp8_e4m3"}, {"quantization": "fp8"},
                                   {"kv_cache_dtype": "fp8_e4m3", "quantization": "fp8"}],
                         ids=["fp8_kv", "fp8_weights", "both"])
def test_engine_fp8_chunked_cached_mixed(make_engine, tiny_llama, pool_full, extra: dict) -> None:
    prompts = _prompts()
    ref = make_engine(tiny_llama, chunked_prefill_size=16, enable_mixed_chunk=True)
    want = [o["output_ids"] for o in ref.generate(input_ids=prompts, sampling_params=GREEDY)]
    engine = make_engine(tiny_llama, chunked_prefill_size=16, enable_mixed_chunk=True, **extra)
    first = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    again = engine.generate(input_ids=prompts, sampling_params=GREEDY)  # prefixes now come from the cache
    assert sum(o["usage"]["cached_tokens"] for o in again) >= 6 * 40
    got = [o["output_ids"] for o in first + again]
    assert all(len(ids) == 12 for ids in got)
    agree = sum(a == b for w, g in zip(want * 2, got, strict=True) for a, b in zip(w, g, strict=True))
    assert agree >= 0.8 * 12 * 12, agree  # random tiny weights have near-ties; the bench measures this
    pool_full(engine)
