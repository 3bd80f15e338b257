"""Abort frees everything a request holds, whether it was waiting, running, or its consumer just left."""

from __future__ import annotations

import asyncio

import pytest

LONG = {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}


async def first_delta(stream) -> object:
    return await anext(stream)


async def drain(stream) -> list:
    return [o async for o in stream]


@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["cache", "nocache"])
async def test_abort_waiting_and_running(make_engine, tiny_llama, pool_full, disable_radix_cache: bool):
    # One running slot: the second request must wait behind the first.
    engine = make_engine(tiny_llama, max_running_requests=1, disable_radix_cache=disable_radix_cache)
    running = engine.make_request(input_ids=list(range(10, 30)), sampling_params=LONG, rid="running")
    waiting = engine.make_request(input_ids=list(range(40, 55)), sampling_params=LONG, rid="waiting")
    s_run, s_wait = engine.stream(running), engine.stream(waiting)
    first = await first_delta(s_run)
    assert first.new_token_ids and not first.finished
    wait_task = asyncio.create_task(drain(s_wait))
    await asyncio.sleep(0.05)
    assert engine.get_stats().num_queue_reqs == 1

    await engine.abort("waiting")
    wait_outs = await asyncio.wait_for(wait_task, 5)
    assert wait_outs[-1].finished and wait_outs[-1].finish_reason.kind == "abort"
    assert sum(len(o.new_token_ids) for o in wait_outs) == 0  # it never ran

    await engine.abort("running")
    run_outs = await asyncio.wait_for(drain(s_run), 5)
    assert run_outs[-1].finish_reason.kind == "abort"
    generated = len(first.new_token_ids) + sum(len(o.new_token_ids) for o in run_outs)
    assert 0 < generated < LONG["max_new_tokens"]
    pool_full(engine)

    # Aborting an unknown or finished request is harmless, and the engine keeps serving.
    await engine.abort("running")
    await engine.abort("no-such-request")
    out = await engine.async_generate(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 3})
    assert len(out["output_ids"]) == 3


@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["cache", "nocache"])
async def test_closing_stream_early_aborts(make_engine, tiny_llama, pool_full, disable_radix_cache: bool):
    engine = make_engine(tiny_llama, disable_radix_cache=disable_radix_cache)
    other = asyncio.ensure_future(engine.async_generate(
        input_ids=list(range(100, 130)), sampling_params={"temperature": 0, "max_new_tokens": 40}))
    call = engine.async_generate(input_ids=list(range(10, 40)), sampling_params=LONG, stream=True)
    gen = call.__aiter__()
    deltas = [await anext(gen) for _ in range(3)]
    assert not deltas[-1]["finished"]
    await gen.aclose()  # the client went away
    # Closing must reach the engine at once, not whenever the garbage collector finalizes the inner stream:
    # the stream's consumer is gone (a discarding one holds the rid until the abort's last output).
    from runtime.engine import _discard

    assert engine._consumers.get(call.req.rid) in (None, _discard)
    done = await asyncio.wait_for(other, 10)  # the request beside it is untouched
    assert len(done["output_ids"]) == 40
    pool_full(engine)
    assert engine.get_stats().num_running_reqs == 0


async def test_abort_mid_chunked_prefill(make_engine, tiny_llama, pool_full):
    """An abort that lands between two chunks of a prompt frees the chunks already prefilled."""
    engine = make_engine(tiny_llama, chunked_prefill_size=4)
    req = engine.make_request(input_ids=list(range(3, 203)), sampling_params=LONG, rid="chunked")
    stream = engine.stream(req)
    task = asyncio.create_task(drain(stream))
    for _ in range(200):  # until the scheduler has started on it
        if engine.scheduler.chunked_req is not None:
            break
        await asyncio.sleep(0.001)
    await engine.abort("chunked")
    outs = await asyncio.wait_for(task, 5)
    assert outs[-1].finish_reason.kind == "abort"
    pool_full(engine)


def test_finished_request_frees_kv(make_engine, tiny_llama, pool_full):
    engine = make_engine(tiny_llama, disable_radix_cache=True)
    out = engine.generate(input_ids=list(range(3, 40)), sampling_params={"temperature": 0, "max_new_tokens": 9})
    assert out["finish_reason"] in ("length", "stop")
    pool_full(engine)
    assert engine.scheduler.kv.allocator.available_size() == engine.get_stats().max_total_tokens

    cached = make_engine(tiny_llama)
    out = cached.generate(input_ids=list(range(3, 40)), sampling_params={"temperature": 0, "max_new_tokens": 9})
    pool_full(cached)
    # With the cache on, the finished request's KV stays as evictable cache, none of it locked.
    stats = cached.get_stats()
    assert stats.num_used_tokens == 0
    assert stats.num_cached_tokens == 37 + len(out["output_ids"]) - 1


def test_abort_that_overtakes_its_request_ends_it_on_arrival(engine, pool_full):
    # The gateway can abort a choice before the task that submits it has run: the scheduler must still
    # end that request when it arrives instead of generating it to the end.
    from runtime.messages import GenerateRequest
    from runtime.sampling.params import SamplingParams

    engine.scheduler.abort("early-1")
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert out["finish_reason"] == "length"  # unrelated requests are untouched

    async def run():
        outs = [o async for o in engine.stream(GenerateRequest(
            rid="early-1", input_ids=[5, 6, 7], sampling_params=SamplingParams(max_new_tokens=200)))]
        return outs[-1]

    import asyncio

    last = asyncio.run(run())
    assert last.finished and last.finish_reason.kind == "abort" and last.completion_tokens == 0
    pool_full(engine)


def test_rid_of_a_disconnected_stream_is_not_reused_while_it_runs(engine, pool_full):
    # A client that drops a stream and retries with the same rid must get a clear error, not the old
    # request's abort or a request nobody reads.
    import asyncio
    import contextlib

    from runtime.errors import InvalidRequestError

    async def run():
        g = engine.make_request(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 200, "ignore_eos": True},
                                rid="reused")
        async with contextlib.aclosing(engine.stream(g)) as s:
            async for _ in s:
                break
        g2 = engine.make_request(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 5}, rid="reused")
        with pytest.raises(InvalidRequestError, match="already in use"):
            async for _ in engine.stream(g2):
                pass
        for _ in range(200):  # once the old one is gone, the rid is free again and works normally
            if "reused" not in engine._consumers:
                break
            await asyncio.sleep(0.01)
        outs = [o async for o in engine.stream(g2)]
        return outs[-1]

    last = asyncio.run(run())
    assert last.finish_reason.kind == "length" and last.completion_tokens == 5
    pool_full(engine)
