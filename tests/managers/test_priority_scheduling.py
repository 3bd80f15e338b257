"""Request priorities on a live Engine: the order of service when the running slots or the KV pool are full
(better priority first, FCFS within one), and preemption: a better-priority request retracts a running one,
which later finishes with exactly HF's greedy tokens; nothing is lost, the pool ends full."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

GREEDY = {"temperature": 0, "ignore_eos": True}


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 399) for _ in range(n)]


def slow_steps(engine: Any, monkeypatch: Any, seconds: float = 0.004) -> None:
    """Each step a little longer (plain or overlapped), so a running request reliably outlives the client's
    next actions."""
    for name in ("run_batch", "finish_batch"):
        def slow(*args: Any, _call=getattr(engine.worker, name), **kw: Any) -> Any:
            time.sleep(seconds)
            return _call(*args, **kw)

        monkeypatch.setattr(engine.worker, name, slow)


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("full", ["slots", "kv"])
async def test_better_priority_is_served_first_fcfs_within_one(make_engine, tiny_llama, monkeypatch, full):
    """Behind a blocker, four requests queue (priorities 1, 5, 1, 3; SGLang's default: higher first; a threshold
    no gap passes, so nothing is preempted); with one running slot, or a pool that holds one at a time, they
    start 5, 3, then the two 1s in arrival order."""
    limits = {"max_running_requests": 1} if full == "slots" else {"max_total_tokens": 64, "disable_radix_cache": True}
    engine = make_engine(tiny_llama, schedule_policy="fcfs", enable_priority_scheduling=True,
                         priority_scheduling_preemption_threshold=1000, **limits)
    slow_steps(engine, monkeypatch)
    blocker = engine.make_request(input_ids=ids(1, 30), sampling_params={**GREEDY, "max_new_tokens": 34},
                                  rid="blocker")
    stream = engine.stream(blocker)
    await anext(stream)
    order: list[str] = []

    async def one(name: str, priority: int) -> None:
        out = await engine.async_generate(input_ids=ids(ord(name[0]), 30),
                                          sampling_params={**GREEDY, "max_new_tokens": 10}, priority=priority)
        assert out["finish_reason"] == "length"
        order.append(name)

    tasks = []
    for name, priority in (("a1", 1), ("b5", 5), ("c1", 1), ("d3", 3)):
        tasks.append(asyncio.create_task(one(name, priority)))
        await until(lambda n=len(tasks): engine.get_stats().num_queue_reqs == n)
    await engine.abort("blocker")
    async for _ in stream:
        pass
    await asyncio.gather(*tasks)
    assert order == ["b5", "d3", "a1", "c1"]
    assert engine.get_stats().retractions == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_preempted_request_finishes_with_hf_greedy_tokens(make_engine, tiny_llama, hf_greedy, monkeypatch,
                                                                overlap):
    """vLLM's spelling (lower value first, any better priority preempts): the only running slot is held by a
    priority-5 request; a priority-0 one retracts it, runs, finishes first; the retracted one is re-prefilled
    with its output so far and ends with exactly HF's greedy continuation. With overlap scheduling the batch in
    flight is collected first (on CPU the launch is synchronous; the bookkeeping is the GPU's)."""
    engine = make_engine(tiny_llama, max_running_requests=1, scheduling_policy="priority")
    engine.scheduler.overlap = overlap
    slow_steps(engine, monkeypatch)
    prompt = ids(1, 12)
    low = engine.make_request(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 60}, rid="low",
                              priority=5)
    stream = engine.stream(low)
    got = list((await anext(stream)).new_token_ids)
    order: list[str] = []

    async def urgent() -> dict:
        out = await engine.async_generate(input_ids=ids(2, 10), sampling_params={**GREEDY, "max_new_tokens": 8},
                                          priority=0)
        order.append("urgent")
        return out

    task = asyncio.create_task(urgent())
    async for o in stream:
        got += o.new_token_ids
        last = o
    order.append("low")
    out = await task
    assert order == ["urgent", "low"]
    assert last.finish_reason.kind == "length" and got == hf_greedy(prompt, 60)
    assert out["output_ids"] == hf_greedy(ids(2, 10), 8)
    assert engine.scheduler.priority.preempted == 1 and engine.get_stats().retractions == 1


@pytest.mark.parametrize("kw", [{}, {"enable_mixed_chunk": True, "chunked_prefill_size": 8}], ids=["plain", "mixed"])
async def test_preemption_for_kv_keeps_every_output_exact(make_engine, tiny_llama, hf_greedy, monkeypatch, kw):
    """Two priority-0 requests fill a small pool; a priority-50 one (SGLang: higher first, gap > 10) cannot
    start for lack of KV and retracts one of them. All three end with HF's tokens; the pool ends full. Also
    with MIXED steps, whose decodes keep a slot each free of the prefill."""
    engine = make_engine(tiny_llama, max_total_tokens=96, enable_priority_scheduling=True, **kw)
    slow_steps(engine, monkeypatch)
    lows = [ids(10 + i, 20) for i in range(2)]
    tasks = [asyncio.create_task(engine.async_generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 40}))
             for p in lows]
    await until(lambda: engine.get_stats().num_running_reqs == 2)
    urgent = await engine.async_generate(input_ids=ids(3, 20), sampling_params={**GREEDY, "max_new_tokens": 10},
                                         priority=50)
    outs = await asyncio.gather(*tasks)
    assert engine.scheduler.priority.preempted >= 1
    assert urgent["output_ids"] == hf_greedy(ids(3, 20), 10)
    for p, o in zip(lows, outs):
        assert o["finish_reason"] == "length" and o["output_ids"] == hf_greedy(p, 40)


def test_engine_generate_takes_priority_per_prompt(make_engine, tiny_llama):
    from runtime.errors import InvalidRequestError

    plain = make_engine(tiny_llama)
    with pytest.raises(InvalidRequestError) as ei:
        plain.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}, priority=1)
    assert ei.value.param == "priority"
    engine = make_engine(tiny_llama, scheduling_policy="priority")
    outs = engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 2}, priority=[3, -1])
    assert [len(o["output_ids"]) for o in outs] == [2, 2]
    for bad in ([1], "high", 1.0):
        with pytest.raises(InvalidRequestError) as ei:
            engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 2}, priority=bad)
        assert ei.value.param == "priority"
