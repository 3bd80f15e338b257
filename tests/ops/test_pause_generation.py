"""Pause / continue (SchedulerHost.pause_generation; SGLang's /pause_generation, /continue_generation) on one
tiny-Llama Engine, outputs against HF greedy: "abort" ends the running request (finish_reason abort, KV freed);
"retract" frees its KV and the request, recomputed after continue, still gives HF's tokens; "in_place" keeps
its KV (no recompute) and gives HF's tokens; no step runs while paused; requests sent while paused wait (held,
abortable) and run after continue; pause -> update_weights_from_disk(B) -> continue serves HF-on-B; an update
that would flush under a request paused in place is refused; the HTTP routes answer in SGLang's shapes with
/health 200 while paused; shutdown while paused returns and ends what waited."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from collect_failure import fail_the_collect_a_pause_makes
from tiny_models import hf_greedy_ids, make_tiny_model

from runtime import Engine
from runtime.errors import InvalidRequestError

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]
N = 24
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpts(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    return {"a": tiny_llama, "b": make_tiny_model("llama", tmp_path_factory.mktemp("pause") / "b", seed=1)}


@pytest.fixture(scope="module")
def expected(ckpts) -> dict[str, list[int]]:
    return {k: hf_greedy_ids(ckpts[k], PROMPT, N) for k in ("a", "b")}


@pytest.fixture(scope="module")
def engine(ckpts):
    e = Engine(str(ckpts["a"]), device="cpu", dtype="float32", max_total_tokens=2048, log_level="warning")
    yield e
    e.shutdown()


def _pool_full(engine: Engine) -> None:
    """Nothing held: every slot free or evictable cache, no cache node locked, every table row free."""
    s = engine.scheduler
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with s.lock:
            if not s.reqs and not s.has_work() and s.inbox.empty():
                break
        time.sleep(0.01)
    with s.lock:
        s.check_kv_invariant()
        kv = s.kv
        assert kv.cache.protected_size() == 0 and kv.req_slots.available_size() == kv.req_slots.size
        assert kv.allocator.available_size() + kv.cache.evictable_size() == kv.size
    assert engine.get_stats().num_used_tokens == 0 and not engine.host.paused


LONG = 200


def _started(engine: Engine, n: int) -> asyncio.Future:
    """A greedy request of n tokens, submitted (_running_req waits for it to run)."""
    fut = asyncio.ensure_future(engine.async_generate(input_ids=PROMPT, sampling_params={"max_new_tokens": n,
                                                                                          **GREEDY}))
    return fut


async def _running_req(engine: Engine, fut: asyncio.Future | None = None, min_out: int = 3,
                       freeze: bool = True) -> Any:
    """The request of fut once it runs with min_out tokens. freeze: the scheduler takes no step after that
    (its pause flag, set on its own thread as it picks the next batch, which pause_generation then keeps), so
    the pause lands on a running request however slowly the host sends it. Without: asked between two steps
    through the inbox (polling under the scheduler's lock starves while it steps back to back; on CI the
    request once finished unseen and this waited forever)."""
    s = engine.scheduler
    pick = s.get_next_batch_to_run

    def picking() -> Any:
        if any(len(r.output_ids) >= min_out for r in s.running):
            s.paused = True
        return pick()

    def seen() -> list[Any]:
        return [r for r in s.running if len(r.output_ids) >= min_out and (s.paused or not freeze)]

    if freeze:
        s.get_next_batch_to_run = picking
    try:
        deadline = time.monotonic() + 60
        while True:
            live = await asyncio.to_thread(engine.host.call, seen)
            if live:
                return live[0]
            assert fut is None or not fut.done(), f"the request finished before it was seen running: {fut.result()}"
            assert time.monotonic() < deadline, "the request never ran"
            await asyncio.sleep(0.001)
    finally:
        if freeze:
            del s.get_next_batch_to_run


async def _still(engine: Engine, req: Any) -> int:
    """No step runs while paused: the request's output does not grow."""
    before = len(req.output_ids)
    batches = engine.scheduler.batch_id
    await asyncio.sleep(0.15)
    assert len(req.output_ids) == before and engine.scheduler.batch_id == batches
    return before


def test_abort_mode_ends_running_requests_and_frees_their_kv(engine, expected):
    async def scenario() -> tuple[Any, Any]:
        first = _started(engine, 400)
        await _running_req(engine, first)
        await asyncio.to_thread(engine.pause_generation)  # SGLang's default mode: abort
        out = await first
        assert engine.get_stats().num_used_tokens == 0  # freed while still paused
        waiting = asyncio.ensure_future(engine.async_generate(input_ids=PROMPT, sampling_params={
            "max_new_tokens": N, **GREEDY}))
        await asyncio.sleep(0.15)
        assert not waiting.done() and engine.get_stats().num_queue_reqs == 0  # held, not refused
        await asyncio.to_thread(engine.pause_generation, "abort")  # again: never touches the held request
        assert not waiting.done()
        await asyncio.to_thread(engine.continue_generation)
        return out, await waiting

    out, later = asyncio.run(scenario())
    assert out["finish_reason"] == "abort" and len(out["output_ids"]) < 400
    assert later["output_ids"] == expected["a"]
    _pool_full(engine)


@pytest.mark.parametrize("mode, retractions", [("retract", 1), ("in_place", 0)])
def test_paused_request_finishes_with_hf_tokens(engine, expected, mode, retractions):
    async def scenario() -> tuple[Any, Any]:
        fut = _started(engine, N)
        req = await _running_req(engine, fut, min_out=4)
        await asyncio.to_thread(engine.pause_generation, mode)
        stats = engine.get_stats()
        if mode == "retract":  # back in the queue, its own KV freed (recomputed after continue)
            assert (stats.num_running_reqs, stats.num_queue_reqs, stats.num_used_tokens) == (0, 1, 0)
            assert req.req_pool_idx is None
        else:  # as it was: running, its KV held
            assert stats.num_running_reqs == 1 and stats.num_used_tokens == req.kv_len > 0  # its own + its locked prefix
        kv = req.kv_indices.clone() if mode == "in_place" else None
        await _still(engine, req)
        await asyncio.to_thread(engine.pause_generation, mode)  # pausing twice is harmless
        await _still(engine, req)
        if kv is not None:
            assert torch.equal(req.kv_indices[: len(kv)], kv)
        await asyncio.to_thread(engine.continue_generation)
        return await fut, req

    out, req = asyncio.run(scenario())
    assert out["output_ids"] == expected["a"] and out["finish_reason"] == "length"
    assert req.retractions == retractions  # in place: no recompute
    _pool_full(engine)


def test_continue_without_pause_and_held_abort(engine, expected):
    engine.continue_generation()  # nothing paused: nothing happens
    assert engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": N, **GREEDY})["output_ids"] \
        == expected["a"]
    with pytest.raises(InvalidRequestError) as e:
        engine.pause_generation("freeze")
    assert e.value.param == "mode" and not engine.host.paused

    async def scenario() -> Any:
        await asyncio.to_thread(engine.pause_generation, "in_place")
        held = asyncio.ensure_future(engine.async_generate(input_ids=PROMPT, sampling_params={"max_new_tokens": N},
                                                           rid="held-1"))
        while not engine.host._held:
            await asyncio.sleep(0.001)
        engine.abort("held-1")
        out = await held
        await asyncio.to_thread(engine.continue_generation)
        return out

    assert asyncio.run(scenario())["finish_reason"] == "abort"
    _pool_full(engine)


def test_pause_update_continue_serves_b(engine, ckpts, expected):
    async def scenario() -> tuple[Any, Any, Any]:
        await asyncio.to_thread(engine.pause_generation, "retract")
        waiting = asyncio.ensure_future(engine.async_generate(input_ids=PROMPT, sampling_params={
            "max_new_tokens": N, **GREEDY}))
        while not engine.host._held:
            await asyncio.sleep(0.001)
        update = await asyncio.to_thread(engine.update_weights_from_disk, str(ckpts["b"]))  # never waits for steps
        assert not waiting.done()
        await asyncio.to_thread(engine.continue_generation)
        return update, await waiting, engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": N,
                                                                                         **GREEDY})

    (ok, message, paused), waited, fresh = asyncio.run(scenario())
    assert ok and paused == 1, message
    assert waited["output_ids"] == expected["b"] and fresh["output_ids"] == expected["b"]
    assert engine.update_weights_from_disk(str(ckpts["a"]))[0]
    _pool_full(engine)


def test_update_under_a_request_paused_in_place(engine, ckpts, expected):
    async def scenario() -> tuple[Any, Any, Any]:
        fut = _started(engine, LONG)  # long enough to be running still when the pause lands, however slow the host
        await _running_req(engine, fut)
        await asyncio.to_thread(engine.pause_generation, "in_place")
        refused = await asyncio.to_thread(engine.update_weights_from_disk, str(ckpts["b"]))
        kept = await asyncio.to_thread(engine.update_weights_from_disk, str(ckpts["b"]), flush_cache=False)
        await asyncio.to_thread(engine.continue_generation)
        return refused, kept, await fut

    (ok, message, _), (kept_ok, _, _), out = asyncio.run(scenario())
    assert not ok and "flush_cache=false" in message and "paused in place" in message
    assert kept_ok and len(out["output_ids"]) == LONG  # it went on over its old KV, as SGLang's in_place does
    assert engine.update_weights_from_disk(str(ckpts["a"]))[0]  # flushes the stale prefixes
    assert engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": N, **GREEDY})["output_ids"] \
        == expected["a"]
    _pool_full(engine)


def test_http_routes(engine, expected):
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    async def go() -> None:
        async with TestClient(TestServer(build_app(engine, engine.args))) as http:
            for bad in ({"mode": "freeze"}, {"mode": 3}):
                r = await http.post("/pause_generation", json=bad)
                assert r.status == 400 and json.loads(await r.text())["error"]["param"] == "mode"
            r = await http.post("/continue_generation")  # nothing paused
            assert r.status == 200
            r = await http.post("/pause_generation", json={"mode": "retract"})
            assert r.status == 200 and await r.json() == {"message": "Generation paused successfully.",
                                                          "status": "ok"}
            assert (await http.get("/health")).status == 200
            gen = asyncio.ensure_future(http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
                "max_new_tokens": N, **GREEDY}}))
            await asyncio.sleep(0.2)
            assert not gen.done()
            r = await http.post("/continue_generation", json={"torch_empty_cache": True})
            assert r.status == 200 and (await r.json())["message"] == "Generation continued successfully."
            r = await gen
            assert r.status == 200 and (await r.json())["output_ids"] == expected["a"]
            r = await http.post("/pause_generation")  # no body: SGLang's default, abort
            assert r.status == 200 and engine.host.paused == "abort"
            assert (await http.post("/continue_generation")).status == 200

    asyncio.run(go())
    _pool_full(engine)


def test_shutdown_while_paused(ckpts):
    e = Engine(str(ckpts["a"]), device="cpu", dtype="float32", max_total_tokens=512, log_level="warning")

    async def scenario() -> Any:
        await asyncio.to_thread(e.pause_generation, "in_place")
        held = asyncio.ensure_future(e.async_generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4}))
        while not e.host._held:
            await asyncio.sleep(0.001)
        t0 = time.monotonic()
        await asyncio.to_thread(e.shutdown)
        assert time.monotonic() - t0 < 5
        return await asyncio.wait_for(held, 5)

    assert asyncio.run(scenario())["finish_reason"] == "abort"


def test_a_batch_failing_as_the_pause_collects_it_fails_its_requests(tiny_llama, monkeypatch):
    """With overlap scheduling (forced on: CPU runs without it) a pause first collects the batch in flight; if
    that raises, its requests end with an error as a failed step's do, instead of waiting forever."""
    import threading

    from runtime.managers import scheduler_host

    monkeypatch.setattr(scheduler_host, "overlap_wanted", lambda *a: True)
    engine = Engine(str(tiny_llama), device="cpu", dtype="float32", max_total_tokens=2048, log_level="warning")
    try:
        s, out = engine.scheduler, {}
        thread = threading.Thread(target=lambda: out.setdefault("r", engine.generate(
            input_ids=PROMPT, sampling_params={"max_new_tokens": 300, **GREEDY})))
        thread.start()
        asyncio.run(_running_req(engine, freeze=False))  # the pause must find a batch in flight
        fail_the_collect_a_pause_makes(monkeypatch, s)
        with pytest.raises(Exception, match="device error in flight"):
            engine.pause_generation("in_place")
        thread.join(15)
        assert not thread.is_alive() and out["r"]["finish_reason"] == "error"
        engine.continue_generation()
        _pool_full(engine)
    finally:
        engine.shutdown()
