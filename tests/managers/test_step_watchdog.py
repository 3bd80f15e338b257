"""Engine health follow-ups: the step watchdog (runtime/managers/step_watchdog.py, SGLang's --watchdog-timeout), the
health published before a failed step's errors, and a pause whose collect fails counted once.

A step that hangs (a worker call that never returns) makes the in-process engine unhealthy once it has run past
--watchdog-timeout: GET /health answers 503 with "a step has run for N s (--watchdog-timeout)", new requests are
refused, and every thread's stack (the hanging call's frame in the scheduler thread's) is logged once at ERROR. The
requests end while the step still hangs: the one in the step with an error naming the watchdog (code None: on Ray not
moved), one queued with ENGINE_UNHEALTHY (moved on Ray), and a SchedulerActor over that host answers unhealthy with
both in that very answer (published before the verdict is read); a step that returns after all leaves nothing held.
Slow steps that finish under the timeout, calls run on the scheduler thread between steps for longer than it (a weight
update takes minutes) and IDLE steps (a DP rank waiting for its peers) leave it healthy; <= 0, None or inf turns the
watchdog off (no thread); NaN is refused naming the flag. When a step's failure makes the engine unhealthy, the sink
that delivers the failing request's error already sees it unhealthy, and a reader on another thread waits for that
delivery (on Ray the answer saying unhealthy carries those errors). A failure between steps times its probe. A
collect that fails as a pause takes the batch in flight counts one failure, not two."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from test_engine_health import GREEDY, PROMPT, STICKY, N, break_worker

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


def test_the_watchdog_flags_only_a_step_past_the_timeout():
    health = StepHealth()
    dog = StepWatchdog(10.0, health)
    assert dog.overdue() is None  # between steps
    dog.started = time.monotonic() - 9.5  # slow, but under the timeout
    assert dog.overdue() is None and not dog.check(threading.current_thread()) and health.state.healthy
    dog.started = time.monotonic() - 10.5
    assert 10.5 <= dog.overdue() < 12
    assert dog.check(threading.current_thread())
    assert not health.state.healthy and health.state.reason.startswith("a step has run for 10.")
    assert health.state.reason.endswith(" s (--watchdog-timeout)")
    for off in (None, 0, -1.0, math.inf):
        dog = StepWatchdog(off, StepHealth())
        dog.started = time.monotonic() - 1e6
        assert dog.timeout_s is None and dog.overdue() is None
        before = set(threading.enumerate())
        with dog.watching():  # no thread is started
            assert set(threading.enumerate()) == before


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

    from runtime.cluster.scheduler_actor import SchedulerActor
    from runtime.gateway.app import build_app
    from runtime.managers import step_watchdog

    engine = make_engine(tiny_llama, watchdog_timeout=TIMEOUT_S)
    s = engine.scheduler
    records = Records()
    logging.getLogger(step_watchdog.__name__).addHandler(records)
    real, mode, release = engine.worker.run_batch, {"slow": 0, "hang": False}, threading.Event()
    queued = engine.make_request(input_ids=PROMPT, sampling_params=GREEDY)
    actor = SchedulerActor(ServerArgs(), "/m", SimpleNamespace(rank=0))  # what a Ray client hears of the same host
    actor.host = engine.host
    actor._owner.update({"hung": "client", queued.rid: "client"})
    sink, answers = s.sink, []

    def both(outputs: list) -> None:
        if threading.current_thread().name.endswith("-watchdog"):
            time.sleep(0.2)  # a slow delivery: readers of the health wait for it
        actor._sink(outputs)
        sink(outputs)

    def hang_in_the_forward(batch: Any) -> Any:
        if mode["hang"]:
            mode["hang"] = False
            s._add(queued)  # queued behind the stuck step: never in it
            release.wait(30)
        elif mode["slow"]:
            mode["slow"] -= 1
            time.sleep(0.4 * TIMEOUT_S)
        return real(batch)

    def poll_until_unhealthy() -> None:  # the Ray client's pump: every answer, in order
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (not answers or answers[-1].healthy):
            answers.append(actor._answer("client", None))
            time.sleep(0.02)

    monkeypatch.setattr(engine.worker, "run_batch", hang_in_the_forward)
    monkeypatch.setattr(s, "sink", both)
    try:
        mode["slow"] = 3  # slow steps that finish under the timeout (1.2 s in all: past it, summed)
        out = await asyncio.to_thread(engine.generate, input_ids=PROMPT, sampling_params=GREEDY)
        assert out["output_ids"] == hf_greedy(PROMPT, N)
        await asyncio.to_thread(engine.host.call, lambda: time.sleep(1.5 * TIMEOUT_S))  # a call: no step
        assert engine.health() == EngineHealth() and not records.records

        mode["hang"] = True
        poller = threading.Thread(target=poll_until_unhealthy)
        poller.start()
        task = asyncio.create_task(asyncio.to_thread(engine.generate, input_ids=PROMPT, sampling_params=GREEDY,
                                                     rid="hung"))
        out = await asyncio.wait_for(task, 10)  # ended while its step still hangs: no client waits on it
        assert not release.is_set() and out["finish_reason"] == "error" and out["output_ids"] == []
        reason = engine.health().reason
        assert reason is not None and reason.startswith("a step has run for ") and reason.endswith(
            " s (--watchdog-timeout)")
        assert TIMEOUT_S <= float(reason.split()[5]) < TIMEOUT_S + 5  # seen within a poll (TIMEOUT_S / 4)
        assert out["error"] == f"internal error: the scheduler step running this request hung: {reason}"
        poller.join(10)
        *before, last = answers  # the answer that first says unhealthy carries both ends
        assert all(a.healthy and not a.outputs for a in before) and not last.healthy and last.error == reason
        assert {o.rid: o.finish_reason for o in last.outputs} == {
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
        stuck = text.split("Thread shoal-scheduler (the step):")[1].split("\nThread ")[0]
        assert "in hang_in_the_forward" in stuck and "release.wait(30)" in stuck  # where it hangs
        release.set()  # the step ends after all: its requests were aborted, the engine stays unhealthy (restart it)
        await asyncio.to_thread(engine.get_stats)  # a call: handled after those aborts, in the inbox before it
        assert engine.health().reason == reason and s.watchdog.started is None and not s.reqs
        assert not actor._answer("client", None).outputs  # what the step said of them after went nowhere
    finally:
        release.set()
        logging.getLogger(step_watchdog.__name__).removeHandler(records)


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


def test_the_engine_is_unhealthy_before_the_failing_request_hears_its_error(make_engine, tiny_llama, monkeypatch):
    engine = make_engine(tiny_llama, watchdog_timeout=0)
    s = engine.scheduler
    assert s.watchdog.timeout_s is None
    seen: dict[str, Any] = {}
    sink = s.sink

    def delivering(outputs: list) -> None:
        if any(o.finished and o.finish_reason.kind == "error" for o in outputs) and "sink" not in seen:
            seen["sink"] = engine.health()  # the scheduler thread, delivering the error
            reader = threading.Thread(target=lambda: seen.setdefault("reader", (engine.health(), time.monotonic())))
            reader.start()  # another thread (the gateway's /health, a Ray actor's answer) waits for the delivery
            time.sleep(0.2)
            seen["delivered"] = time.monotonic()
            sink(outputs)
            seen["thread"] = reader
            return
        sink(outputs)

    monkeypatch.setattr(s, "sink", delivering)
    break_worker(engine, monkeypatch, STICKY)
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert out["finish_reason"] == "error" and "illegal memory access" in out["error"]
    assert not seen["sink"].healthy and "illegal memory access" in seen["sink"].reason
    seen["thread"].join(5)
    health, answered = seen["reader"]
    assert health == seen["sink"] and answered >= seen["delivered"]


def test_a_pause_whose_collect_fails_counts_one_failure(tiny_llama, monkeypatch, make_engine, hf_greedy):
    """pause_now's collect failure goes through fail_step once; SchedulerHost.call hands the error to the caller
    (run_forever never sees it), so the failure count is 1, not 2 (3 would run a probe)."""
    from runtime.managers import scheduler_host

    monkeypatch.setattr(scheduler_host, "overlap_wanted", lambda *a: True)  # CPU runs without overlap
    engine = make_engine(tiny_llama)
    s, out = engine.scheduler, {}
    assert s.overlap
    thread = threading.Thread(target=lambda: out.setdefault("r", engine.generate(
        input_ids=PROMPT, sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": 400})))
    thread.start()
    deadline = time.monotonic() + 10
    while not s.running and time.monotonic() < deadline:
        time.sleep(0.005)
    finish, armed = engine.worker.finish_batch, []

    def failing(launched: Any) -> Any:
        if armed:
            armed.clear()
            raise RuntimeError("device error in flight")
        return finish(launched)

    pause_now = s.pause_now

    def arm_then_pause(mode: str) -> int:
        if s.pending is not None:  # a batch in flight (between two steps there may be none: try again)
            armed.append(True)
        return pause_now(mode)

    monkeypatch.setattr(engine.worker, "finish_batch", failing)
    monkeypatch.setattr(s, "pause_now", arm_then_pause)
    for _ in range(50):
        try:
            engine.pause_generation("in_place")
        except RuntimeError as e:
            assert "device error in flight" in str(e)
            break
        engine.continue_generation()  # the pause found no batch in flight
    else:
        pytest.fail("no pause found a batch in flight")
    thread.join(15)
    assert not thread.is_alive() and out["r"]["finish_reason"] == "error"
    assert s.health.failed_in_a_row == 1 and engine.health().healthy and s.watchdog.started is None
    engine.continue_generation()
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == hf_greedy(PROMPT, N)
    assert s.health.failed_in_a_row == 0
