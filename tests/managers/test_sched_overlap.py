"""Overlap scheduling (batch N+1 launched before batch N is collected) gives exactly the outputs of the
plain loop. On CPU the launch is synchronous, but the bookkeeping — placeholder input ids, tokens in
flight, requests that finish one step late — is the same code the GPU runs."""

from __future__ import annotations

import random

import pytest

from runtime import Engine


def _run(model, overlap: bool, prompts, params, **kw):
    e = Engine(str(model), device="cpu", max_total_tokens=kw.pop("max_total_tokens", 4096), **kw)
    e.scheduler.overlap = overlap
    try:
        outs = e.generate(input_ids=prompts, sampling_params=params)
        e.scheduler.check_kv_invariant()
        kv = e.scheduler.kv
        assert kv.allocator.available_size() + kv.cache.evictable_size() == kv.size
        return [o["output_ids"] for o in outs], [o["finish_reason"] for o in outs], e.get_stats()
    finally:
        e.shutdown()


def _prompts(n=10, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 390) for _ in range(20)]
    return [(shared if i % 2 else []) + [rng.randrange(3, 390) for _ in range(rng.randrange(2, 40))]
            for i in range(n)]


@pytest.mark.parametrize("kw", [
    {},
    {"chunked_prefill_size": 8},
    {"enable_mixed_chunk": True, "chunked_prefill_size": 16},
    {"disable_radix_cache": True},
    {"max_total_tokens": 150},  # forces retraction (the overlap loop flushes before retracting)
])
def test_overlap_matches_plain_loop(tiny_llama, kw):
    prompts = _prompts()
    tight = "max_total_tokens" in kw
    params = [{"temperature": 0.0 if i % 3 else 0.9, "seed": i,
               "max_new_tokens": 30 if tight else 1 + (i * 7) % 25,
               "ignore_eos": tight or i % 2 == 0} for i in range(len(prompts))]
    plain = _run(tiny_llama, False, prompts, params, **dict(kw))
    over = _run(tiny_llama, True, prompts, params, **dict(kw))
    assert over[0] == plain[0]
    assert over[1] == plain[1]
    if kw.get("max_total_tokens"):
        assert over[2].retractions > 0


def test_overlap_with_stop_ids_and_penalties(tiny_llama):
    prompts = _prompts(6, seed=1)
    params = [{"temperature": 0.0, "max_new_tokens": 20, "stop_token_ids": [p[-1], 7, 11],
               "repetition_penalty": 1.3 if i % 2 else 1.0, "min_new_tokens": 2} for i, p in enumerate(prompts)]
    assert _run(tiny_llama, True, prompts, params)[:2] == _run(tiny_llama, False, prompts, params)[:2]
