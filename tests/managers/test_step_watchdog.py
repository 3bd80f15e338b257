"""The step watchdog (runtime/managers/step_watchdog.py, SGLang's --watchdog-timeout). A failed step's order of events
is in test_step_failure_order.py.

A step that hangs (a worker call that never returns) makes the in-process engine unhealthy once it has run past
--watchdog-timeout: GET /health answers 503 with "a step has run for N s (--watchdog-timeout)", new requests are
refused, and every thread's stack (the hanging call's frame in the scheduler thread's) is logged once at ERROR. The
requests end while the step still hangs: the one in the step with an error naming the watchdog (code None: on Ray not
moved), one queued with ENGINE_UNHEALTHY (moved on Ray), and a SchedulerActor over that host answers unhealthy with
both in that very answer (published before the verdict is read); a step that returns after all leaves nothing held.
A request submitted during the hang (left in the inbox the stuck thread never drains) ends with the verdict, one
validated before it and submitted after ends at once; calls to the scheduler (admin ones) fail fast while the step
hangs, those already waiting as the verdict lands, and /metrics answers (stats read without the step's lock). A
failed step's errors held through a probe that hangs are delivered by the watchdog, in the first unhealthy answer.
Slow steps that finish under the timeout, calls run on the scheduler thread between steps for longer than it (a weight
update takes minutes) and IDLE steps (a DP rank waiting for its peers) leave it healthy; <= 0, None or inf turns the
watchdog off (no thread); NaN is refused naming the flag. A failure between steps times its probe. The thread is
joined as the step loop ends."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from test_engine_health import GREEDY, PROMPT, N

from runtime.config import ServerArgs
from runtime.engine_client import ENGINE_UNHEALTHY, EngineHealth, EngineUnhealthyError
from runtime.errors import ServerArgsError
from runtime.managers.step_health import StepHealth
from runtime.managers.step_watchdog import StepWatchdog
from runtime.messages import BatchResult, FinishReason
from runtime.model_executor.forward_mode import ForwardMode

TIMEOUT_S = 1.0  # the engine tests' --watchdog-timeout: slow steps take 0.4 s, a hang is seen by ~1.25 s


class Records(logging.Handler):
    """The watchdog's log lines ("runtime" loggers do not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class RayView:
    """A SchedulerActor over the engine's host: what a Ray client hears of it. Every sink call goes to both (a
    slow one, from the watchdog's thread, when slow); poller pumps answers, in order, until one says unhealthy."""

    def __init__(self, engine: Any, monkeypatch: Any, rids: list[str], slow: bool = False):
        from runtime.cluster.scheduler_actor import SchedulerActor

        self.actor = SchedulerActor(ServerArgs(), "/m", SimpleNamespace(rank=0))
        self.actor.host = engine.host
        self.actor._owner.update(dict.fromkeys(rids, "client"))
        self.answers: list[Any] = []
        sink = engine.scheduler.sink

        def both(outputs: list) -> None:
            if slow and threading.current_thread().name.endswith("-watchdog"):
                time.sleep(0.2)  # a slow delivery: readers of the health wait for it
            self.actor._sink(outputs)
            sink(outputs)

        monkeypatch.setattr(engine.scheduler, "sink", both)
        self.poller = threading.Thread(target=self._poll_until_unhealthy)

    def _poll_until_unhealthy(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (not self.answers or self.answers[-1].healthy):
            self.answers.append(self.actor._answer("client", None))
            time.sleep(0.02)

    def first_unhealthy(self) -> Any:
        """The answer that first says unhealthy; those before carry nothing."""
        self.poller.join(10)
        *before, last = self.answers
        assert all(a.healthy and not a.outputs for a in before) and not last.healthy
        return last


def wait_unstuck(s: Any) -> None:
    """Until the step the watchdog flagged has returned (calls are answered again)."""
    deadline = time.monotonic() + 10
    while s.watchdog.stuck() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not s.watchdog.stuck()


def test_the_watchdog_flags_only_a_step_past_the_timeout():
    health = StepHealth()
    dog = StepWatchdog(10.0, health)
    assert dog.overdue() is None  # between steps
    dog.started = time.monotonic() - 9.5  # slow, but under the timeout
    assert dog.overdue() is None and not dog.check(threading.current_thread()) and health.state.healthy
    dog.started = time.monotonic() - 10.5
    assert 10.5 <= dog.overdue() < 12
    assert not dog.stuck() and dog.check(threading.current_thread()) and dog.stuck()
    assert not health.state.healthy and health.state.reason.startswith("a step has run for 10.")
    assert dog.hung == health.state.reason
    assert health.state.reason.endswith(" s (--watchdog-timeout)")
    for off in (None, 0, -1.0, math.inf):
        dog = StepWatchdog(off, StepHealth())
        dog.started = time.monotonic() - 1e6
        assert dog.timeout_s is None and dog.overdue() is None
        before = set(threading.enumerate())
        with dog.watching():  # no thread is started
            assert set(threading.enumerate()) == before


def test_the_watchdog_thread_is_gone_once_the_loop_ends():
    """Its thread holds the scheduler (on_hang): left to end on its own it could keep a shut-down engine's model
    alive a moment (test_gc_guard's collection check failed so, once in a loaded run)."""
    dog = StepWatchdog(300.0, StepHealth())
    before = set(threading.enumerate())
    with dog.watching():
        (watcher,) = set(threading.enumerate()) - before
        assert watcher.name.endswith("-watchdog") and watcher.daemon
    assert not watcher.is_alive()


def test_the_flag():
    assert ServerArgs().watchdog_timeout == 300.0  # SGLang's default
    assert ServerArgs(watchdog_timeout=0).watchdog_timeout == 0  # off, as <= 0 or None
    assert ServerArgs(watchdog_timeout=None).watchdog_timeout is None
    with pytest.raises(ServerArgsError, match="--watchdog-timeout") as e:
        ServerArgs(watchdog_timeout=math.nan)
    assert "<= 0 or inf turns it off" in str(e.value)
    with pytest.raises(ServerArgsError, match="--watchdog-timeout.*must be a float or None"):
        ServerArgs.from_kwargs(watchdog_timeout="300")
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli(parser.parse_args(["--watchdog-timeout", "0"])).watchdog_timeout == 0.0
    assert ServerArgs.from_cli(parser.parse_args(["--watchdog-timeout", "12.5"])).watchdog_timeout == 12.5


async def test_a_hanging_step_makes_the_engine_unhealthy(make_engine, tiny_llama, monkeypatch, hf_greedy):
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app
    from runtime.managers import step_watchdog

    engine = make_engine(tiny_llama, watchdog_timeout=TIMEOUT_S)
    s = engine.scheduler
    records = Records()
    logging.getLogger(step_watchdog.__name__).addHandler(records)
    real, mode, release = engine.worker.run_batch, {"slow": 0, "hang": False}, threading.Event()
    queued = engine.make_request(input_ids=PROMPT, sampling_params=GREEDY)
    ray = RayView(engine, monkeypatch, ["hung", queued.rid], slow=True)

    def hang_in_the_forward(batch: Any) -> Any:
        if mode["hang"]:
            mode["hang"] = False
            s._add(queued)  # queued behind the stuck step: never in it
            release.wait(30)
        elif mode["slow"]:
            mode["slow"] -= 1
            time.sleep(0.4 * TIMEOUT_S)
        return real(batch)

    monkeypatch.setattr(engine.worker, "run_batch", hang_in_the_forward)
    try:
        mode["slow"] = 3  # slow steps that finish under the timeout (1.2 s in all: past it, summed)
        out = await asyncio.to_thread(engine.generate, input_ids=PROMPT, sampling_params=GREEDY)
        assert out["output_ids"] == hf_greedy(PROMPT, N)
        await asyncio.to_thread(engine.host.call, lambda: time.sleep(1.5 * TIMEOUT_S))  # a call: no step
        assert engine.health() == EngineHealth() and not records.records

        mode["hang"] = True
        ray.poller.start()
        task = asyncio.create_task(asyncio.to_thread(engine.generate, input_ids=PROMPT, sampling_params=GREEDY,
                                                     rid="hung"))
        out = await asyncio.wait_for(task, 10)  # ended while its step still hangs: no client waits on it
        assert not release.is_set() and out["finish_reason"] == "error" and out["output_ids"] == []
        reason = engine.health().reason
        assert reason is not None and reason.startswith("a step has run for ") and reason.endswith(
            " s (--watchdog-timeout)")
        assert TIMEOUT_S <= float(reason.split()[5]) < TIMEOUT_S + 5  # seen within a poll (TIMEOUT_S / 4)
        assert out["error"] == f"internal error: the scheduler step running this request hung: {reason}"
        last = ray.first_unhealthy()  # it carries both ends
        assert last.error == reason and {o.rid: o.finish_reason for o in last.outputs} == {
            "hung": FinishReason("error", message=out["error"]),  # code None: its client ends it, never moves it
            queued.rid: FinishReason("error", message=f"the engine is unhealthy: {reason}", code=ENGINE_UNHEALTHY)}
        async with TestClient(TestServer(build_app(engine, engine.args))) as http:
            r = await http.get("/health")
            assert r.status == 503 and await r.json() == {"status": "unhealthy", "reason": reason}
        with pytest.raises(EngineUnhealthyError, match="--watchdog-timeout"):
            await asyncio.to_thread(engine.generate, input_ids=PROMPT, sampling_params=GREEDY)
        await asyncio.sleep(0.6 * TIMEOUT_S)  # the watchdog looks again, and says nothing more
        [line] = records.records
        text = line.getMessage()
        assert "past --watchdog-timeout 1 s" in text and "Thread shoal-scheduler (the step):" in text
        assert "in hang_in_the_forward" in text and "release.wait(30)" in text  # where it hangs
        release.set()  # the step ends after all: its requests were aborted, the engine stays unhealthy (restart it)
        await asyncio.to_thread(wait_unstuck, s)
        await asyncio.to_thread(engine.get_stats)  # a call: handled after those aborts, in the inbox before it
        assert engine.health().reason == reason and s.watchdog.started is None and not s.reqs
        assert not ray.actor._answer("client", None).outputs  # what the step said of them after went nowhere
    finally:
        release.set()
        logging.getLogger(step_watchdog.__name__).removeHandler(records)


async def test_requests_and_calls_meeting_a_hang_end_at_once(make_engine, tiny_llama, monkeypatch):
    """A request submitted during the hang (validated while the engine looked healthy) sits in the inbox the stuck
    thread never drains: it ends with the verdict, ENGINE_UNHEALTHY. One validated before the verdict and submitted
    after it ends in submit. Calls need the lock the stuck step holds: those waiting end as the verdict lands, new
    ones at once (EngineUnhealthyError, a 503), a pause holds nothing back; stats are read without the lock, so
    /metrics answers."""
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    engine = make_engine(tiny_llama, watchdog_timeout=TIMEOUT_S)
    s = engine.scheduler
    real, hanging, release = engine.worker.run_batch, threading.Event(), threading.Event()

    def hang_once(batch: Any) -> Any:
        if not hanging.is_set():
            hanging.set()
            release.wait(30)
        return real(batch)

    monkeypatch.setattr(engine.worker, "run_batch", hang_once)
    racer = engine.make_request(input_ids=PROMPT, sampling_params=GREEDY)  # validated now, submitted after the verdict
    try:
        hung = asyncio.create_task(asyncio.to_thread(engine.generate, input_ids=PROMPT, sampling_params=GREEDY))
        assert await asyncio.to_thread(hanging.wait, 10)
        late = asyncio.create_task(asyncio.to_thread(engine.generate, input_ids=PROMPT, sampling_params=GREEDY,
                                                     rid="late"))
        # Calls waiting since before the verdict: in the inbox (a pause's or an update's waits up to an hour), and
        # one past its timeout waiting for the lock
        on_thread = asyncio.create_task(asyncio.to_thread(engine.host.call, lambda: "ran", 600.0, True))
        locked = asyncio.create_task(asyncio.to_thread(engine.host.call, lambda: "ran", 0.1))
        await asyncio.sleep(0.3)
        assert engine.health().healthy and not late.done() and not on_thread.done() and not locked.done()
        out = await asyncio.wait_for(late, 10)
        reason = engine.health().reason
        assert not release.is_set() and s.watchdog.stuck() and reason.endswith("(--watchdog-timeout)")
        assert out["finish_reason"] == "error" and out["error"] == f"the engine is unhealthy: {reason}"
        assert (await asyncio.wait_for(hung, 1))["error"].startswith("internal error: the scheduler step running")
        for waiting in (on_thread, locked):
            with pytest.raises(EngineUnhealthyError, match="would wait for that step"):
                await asyncio.wait_for(waiting, 1)
        [end] = [o async for o in engine.stream(racer)]
        assert end.finish_reason == FinishReason("error", message=f"the engine is unhealthy: {reason}",
                                                 code=ENGINE_UNHEALTHY)

        began = time.monotonic()
        stats = await asyncio.to_thread(engine.get_stats)  # the stuck step's request holds its prompt's KV
        assert stats.num_used_tokens >= len(PROMPT) and time.monotonic() - began < 0.5
        with pytest.raises(EngineUnhealthyError, match="would wait for that step"):  # a 503 over HTTP
            await asyncio.to_thread(engine.pause_generation, "retract")
        assert engine.host.paused is None and engine.host._held is None  # nothing held back for a continue
        async with TestClient(TestServer(build_app(engine, engine.args))) as http:
            r = await asyncio.wait_for(http.get("/metrics"), 2)
            assert r.status == 200 and "num_used_tokens" in await r.text()
            r = await asyncio.wait_for(http.post("/flush_cache"), 2)
            assert r.status == 503 and (await r.json())["error"]["code"] == "engine_unhealthy"
        assert time.monotonic() - began < 1.5 and s.watchdog.stuck()
    finally:
        release.set()
    await asyncio.to_thread(wait_unstuck, s)
    assert (await asyncio.to_thread(engine.host.call, lambda: "ran")) == "ran"  # the step returned: calls answer
    assert not s.reqs and engine.health().reason == reason


async def test_a_hanging_probe_delivers_the_failed_steps_errors(make_engine, tiny_llama, monkeypatch):
    """A failed step's requests end before its probe, their errors held for the verdict (a client that got its 500
    finds /health 503). Should the probe hang, the watchdog delivers them, with its own verdict: the failed request
    ends with its step's error (code None, never moved), a queued one with ENGINE_UNHEALTHY, both in the Ray
    answer that first says unhealthy."""
    engine = make_engine(tiny_llama, watchdog_timeout=TIMEOUT_S)
    s = engine.scheduler
    engine.host.call(lambda: setattr(s.health, "failed_in_a_row", s.health.limit - 1))  # the next failure probes
    real, calls, release = engine.worker.run_batch, [], threading.Event()
    queued = engine.make_request(input_ids=PROMPT, sampling_params=GREEDY)
    ray = RayView(engine, monkeypatch, ["failed", queued.rid])

    def fail_then_hang_the_probe(batch: Any) -> Any:
        calls.append(batch)
        if len(calls) == 1:
            s._add(queued)  # queued behind the failing step: it holds nothing, so it waits through the probe
            raise RuntimeError("an ordinary step failure")
        if len(calls) == 2:
            release.wait(30)
        return real(batch)

    monkeypatch.setattr(engine.worker, "run_batch", fail_then_hang_the_probe)
    ray.poller.start()
    try:
        out = await asyncio.wait_for(asyncio.to_thread(engine.generate, input_ids=PROMPT, sampling_params=GREEDY,
                                                       rid="failed"), 10)
        assert out["error"] == "internal error: RuntimeError: an ordinary step failure"
        assert not release.is_set() and len(calls) == 2 and s.watchdog.stuck()
        reason = engine.health().reason
        last = ray.first_unhealthy()
        assert last.error == reason and reason.endswith("(--watchdog-timeout)")
        assert {o.rid: o.finish_reason for o in last.outputs} == {
            "failed": FinishReason("error", message=out["error"]),
            queued.rid: FinishReason("error", message=f"the engine is unhealthy: {reason}", code=ENGINE_UNHEALTHY)}
    finally:
        release.set()
        ray.poller.join(10)
    await asyncio.to_thread(wait_unstuck, s)
    await asyncio.to_thread(engine.get_stats)  # the probe returned: its failure's handling is over
    assert not s.undelivered and not s.reqs and engine.health().reason == reason
    assert not ray.actor._answer("client", None).outputs  # the late delivery of those ends went nowhere


def test_idle_steps_are_not_timed_and_a_probe_after_a_failure_between_steps_is(make_engine, tiny_llama,
                                                                              monkeypatch):
    """DP attention: an IDLE step waits in a collective for its peers (one may run a call between its steps,
    untimed there); it runs untimed. A message whose handling fails between steps is followed by a timed probe."""
    engine = make_engine(tiny_llama, watchdog_timeout=0.2)
    s = engine.scheduler
    real, stamps, slow = engine.worker.run_batch, [], [True]

    def run_batch(batch: Any) -> Any:
        stamps.append((ForwardMode(batch.forward_mode), s.watchdog.started))
        if ForwardMode(batch.forward_mode).is_idle():
            if slow:
                slow.clear()
                time.sleep(0.5)  # past the timeout: a peer busy elsewhere
            return BatchResult(batch_id=batch.batch_id, next_token_ids=[], all_idle=True)
        return real(batch)

    monkeypatch.setattr(engine.worker, "run_batch", run_batch)
    monkeypatch.setattr(s, "must_step", True)  # as a DP-attention rank: it steps (IDLE) with nothing to do
    deadline = time.monotonic() + 10
    while slow and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["finish_reason"] == "length"
    monkeypatch.setattr(s, "must_step", False)
    assert engine.health() == EngineHealth()
    modes = {mode for mode, _ in stamps}
    assert ForwardMode.IDLE in modes and ForwardMode.EXTEND in modes and ForwardMode.DECODE in modes
    assert all((started is None) == mode.is_idle() for mode, started in stamps)

    engine.host.call(lambda: setattr(s.health, "failed_in_a_row", s.health.limit - 1))  # the next failure probes
    stamps.clear()

    def failing() -> None:
        raise RuntimeError("a message's handling failed")

    monkeypatch.setattr(s, "_handle", lambda item: failing())  # the idle loop's branch: no step is under way
    s.inbox.put(("abort", "nobody"))
    deadline = time.monotonic() + 10
    while not stamps and time.monotonic() < deadline:
        time.sleep(0.01)
    [(mode, started)] = stamps  # the probe's forward, timed
    assert mode is ForwardMode.EXTEND and started is not None
    monkeypatch.undo()
    engine.get_stats()
    assert s.watchdog.started is None and engine.health() == EngineHealth()  # the probe passed
