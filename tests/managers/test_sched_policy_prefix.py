"""Waiting-queue order (LPM by cached prefix length, FCFS by arrival, LOF by max_new_tokens) and prefix-cache
reuse."""

from __future__ import annotations

import asyncio
import random

import pytest

from runtime.managers.policy import (
    FCFSPolicy,
    LongestOutputFirstPolicy,
    LongestPrefixMatchPolicy,
    create_policy,
)
from runtime.managers.req import Req
from runtime.sampling.params import SamplingParams

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 399) for _ in range(n)]


def test_policy_orders():
    reqs = [Req(f"r{i}", [3, 4, 5], SamplingParams(), 0, frozenset()) for i in range(5)]
    cached = {"r0": 0, "r1": 7, "r2": 3, "r3": 7, "r4": 0}

    def prefix(r: Req) -> int:
        return cached[r.rid]

    lpm = LongestPrefixMatchPolicy().order(reqs, prefix)
    assert [r.rid for r in lpm] == ["r1", "r3", "r2", "r0", "r4"]  # ties keep arrival order
    assert [r.rid for r in FCFSPolicy().order(reqs, prefix)] == ["r0", "r1", "r2", "r3", "r4"]
    assert isinstance(create_policy("lpm", cache_enabled=False), FCFSPolicy)  # nothing to match against
    with pytest.raises(ValueError, match="lof"):
        create_policy("random", cache_enabled=True)


def test_longest_output_first_order():
    lens = {"a": 16, "b": 512, "c": 100, "d": 512, "e": 1}
    reqs = [Req(rid, [3, 4], SamplingParams(max_new_tokens=n), 0, frozenset()) for rid, n in lens.items()]
    policy = create_policy("lof", cache_enabled=True)
    assert isinstance(policy, LongestOutputFirstPolicy)
    assert [r.rid for r in policy.order(reqs, lambda r: 0)] == ["b", "d", "c", "a", "e"]  # ties: arrival
    assert [r.rid for r in reqs] == list(lens)  # the queue itself is left in arrival order


async def test_lof_admits_the_longest_queued_request_first(make_engine, tiny_llama):
    """Behind a blocker holding the only running slot, a short request queued first still runs second."""
    engine = make_engine(tiny_llama, max_running_requests=1, schedule_policy="lof")
    blocker = engine.make_request(input_ids=ids(2, 8), sampling_params={**GREEDY, "max_new_tokens": 480}, rid="blocker")
    stream = engine.stream(blocker)
    await anext(stream)
    order: list[str] = []

    async def one(name: str, n: int) -> None:
        out = await engine.async_generate(input_ids=ids(7, 10), sampling_params={**GREEDY, "max_new_tokens": n})
        assert out["usage"]["completion_tokens"] == n
        order.append(name)

    tasks = [asyncio.create_task(one("short", 3))]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(one("long", 40)))
    await asyncio.sleep(0.02)
    assert engine.get_stats().num_queue_reqs == 2
    async for _ in stream:
        pass
    await asyncio.gather(*tasks)
    assert order == ["long", "short"]


async def run_behind_blocker(engine, shared: list[int]) -> list[str]:
    """With one running slot: warm the cache with `shared`, occupy the slot, queue an unrelated request
    then one sharing the cached prefix; returns the order in which those two finished."""
    await engine.async_generate(input_ids=shared + ids(1, 5), sampling_params=GREEDY)
    blocker = engine.make_request(input_ids=ids(2, 8), sampling_params={**GREEDY, "max_new_tokens": 480, "ignore_eos": True},
                                  rid="blocker")
    stream = engine.stream(blocker)
    await anext(stream)  # it is running: everything after it waits
    order: list[str] = []

    async def one(name: str, prompt: list[int]) -> None:
        await engine.async_generate(input_ids=prompt, sampling_params=GREEDY)
        order.append(name)

    tasks = [asyncio.create_task(one("unrelated", ids(3, 45)))]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(one("shares-prefix", shared + ids(4, 5))))
    await asyncio.sleep(0.02)
    assert engine.get_stats().num_queue_reqs == 2  # both queued while the blocker runs
    async for _ in stream:
        pass
    await asyncio.gather(*tasks)
    return order


@pytest.mark.parametrize(("policy", "expected"), [
    ("lpm", ["shares-prefix", "unrelated"]), ("fcfs", ["unrelated", "shares-prefix"])])
async def test_queue_order_by_policy(make_engine, tiny_llama, policy: str, expected: list[str]):
    engine = make_engine(tiny_llama, max_running_requests=1, schedule_policy=policy)
    assert await run_behind_blocker(engine, ids(0, 40)) == expected


@pytest.mark.parametrize("chunk", [-1, 16])
def test_prefix_cache_reuse_is_exact(make_engine, tiny_llama, chunk: int):
    shared = ids(0, 40)
    first, second = shared + ids(5, 6), shared + ids(6, 9)
    cold = make_engine(tiny_llama, disable_radix_cache=True, chunked_prefill_size=chunk)
    expected = cold.generate(input_ids=second, sampling_params=GREEDY)
    assert expected["usage"]["cached_tokens"] == 0

    warm = make_engine(tiny_llama, chunked_prefill_size=chunk)
    warm.generate(input_ids=first, sampling_params=GREEDY)
    out = warm.generate(input_ids=second, sampling_params=GREEDY)
    assert out["usage"]["cached_tokens"] >= 39
    assert out["output_ids"] == expected["output_ids"]
    stats = warm.get_stats()
    assert stats.cache_hit_tokens >= 39 and stats.cache_query_tokens == len(first) + len(second)
    # Only the uncached suffix was prefilled the second time.
    assert stats.forward_modes["EXTEND"].tokens == len(first) + len(second) - out["usage"]["cached_tokens"]

    # The same prompt again: everything but the last token is served from the cache, same output.
    again = warm.generate(input_ids=second, sampling_params=GREEDY)
    assert again["usage"]["cached_tokens"] == len(second) - 1
    assert again["output_ids"] == expected["output_ids"]


def test_cache_eviction_under_pressure_stays_exact(make_engine, tiny_llama):
    """A small pool fills with cached prefixes; new requests evict them and still get exact outputs."""
    prompts = [ids(10 + i, 30) for i in range(8)]
    ref = make_engine(tiny_llama, disable_radix_cache=True)
    expected = [o["output_ids"] for o in ref.generate(input_ids=prompts, sampling_params=GREEDY)]
    engine = make_engine(tiny_llama, max_total_tokens=100)
    got = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    assert got == expected
    assert engine.get_stats().evictions > 0
