"""Continuous batching is exact: requests that join and leave a running batch at staggered times get
the same greedy tokens as when each runs alone, and as HF transformers."""

from __future__ import annotations

import asyncio
import random

import pytest

from runtime import Engine


def mixed_workload(n: int = 16, seed: int = 7) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens): prompts of 3..60 tokens, 1..24 new tokens, no special ids."""
    rng = random.Random(seed)
    lengths = [3, 60] + [rng.randint(3, 60) for _ in range(n - 2)]
    news = [1, 24] + [rng.randint(1, 24) for _ in range(n - 2)]
    return [([rng.randint(3, 399) for _ in range(ln)], mn) for ln, mn in zip(lengths, news)]


async def run_staggered(engine: Engine, work: list[tuple[list[int], int]]) -> list[dict]:
    async def one(i: int, ids: list[int], max_new: int) -> dict:
        await asyncio.sleep(0.004 * i)  # arrive while earlier requests are mid-prefill or decoding
        return await engine.async_generate(input_ids=ids, sampling_params={
            "temperature": 0, "max_new_tokens": max_new})

    return await asyncio.gather(*(one(i, ids, mn) for i, (ids, mn) in enumerate(work)))


@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["cache", "nocache"])
async def test_staggered_batch_matches_each_alone(make_engine, tiny_llama, hf_greedy, disable_radix_cache: bool):
    work = mixed_workload()
    ref_engine = make_engine(tiny_llama, disable_radix_cache=True)
    alone = [ref_engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": mn})
             for ids, mn in work]

    engine = make_engine(tiny_llama, disable_radix_cache=disable_radix_cache)
    together = await run_staggered(engine, work)

    for i, (a, t) in enumerate(zip(alone, together)):
        assert t["output_ids"] == a["output_ids"], f"request {i} changed when batched"
        assert t["finish_reason"] == a["finish_reason"]
        assert t["usage"]["prompt_tokens"] == len(work[i][0])
        assert t["usage"]["completion_tokens"] == len(t["output_ids"])
    for i in (0, 1, 5):  # the shortest prompt, the longest one, and one from the middle
        ids, mn = work[i]
        out = alone[i]["output_ids"]
        assert out == hf_greedy(ids, len(out)), f"request {i} differs from HF"
        assert len(out) == mn or alone[i]["finish_reason"] == "stop"

    modes = engine.get_stats().forward_modes
    assert modes["EXTEND"].batches > 0 and modes["DECODE"].batches > 0
    # More decode tokens than decode batches means some decode step ran several requests at once.
    assert modes["DECODE"].tokens > modes["DECODE"].batches
    prompt_tokens = sum(len(ids) for ids, _ in work)
    assert modes["EXTEND"].tokens + modes["MIXED"].tokens <= prompt_tokens
    if disable_radix_cache:  # without the cache every prompt token is prefilled exactly once
        assert modes["EXTEND"].tokens == prompt_tokens
