"""A compile nobody waits for any more never runs: a request that stops waiting for its grammar (aborted,
its client gone, past its deadline) leaves the compile job, and a job no thread has started is dropped
once its last waiter leaves; a job another request still waits for runs. After a storm of abandoned slow
grammars the queue is empty and a benign grammar compiles at once (no 503 busy)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from grammar_hogs import recorded_compiles

from runtime.managers.grammar_manager import GRAMMAR_BUSY, GrammarManager
from runtime.managers.req import Req
from runtime.sampling.grammar_compiler import GrammarCompiler
from runtime.sampling.params import SamplingParams

pytest.importorskip("xgrammar")

VOCAB = [bytes([i]) for i in range(256)] + [b"</s>"]


def counting_compiler(gate: threading.Event, slow_s: float = 0.0, **kw) -> tuple[GrammarCompiler, list[str]]:
    """One compile thread; the regex "hog" holds it until gate is set, a "slow..." one sleeps slow_s.
    Returns the compiler and the texts it compiled, in order."""
    c = GrammarCompiler(VOCAB, len(VOCAB), [256], **{"timeout_s": 30.0, "threads": 1, "fill_threads": 1, **kw})
    calls: list[str] = []
    real = c._compile

    def compile_(kind: str, text: str):
        calls.append(text)
        if text == "hog":
            gate.wait(10)
        elif text.startswith("slow"):
            time.sleep(slow_s)
        return real(kind, text)

    c._compile = compile_
    return c, calls


def req(rid: str, regex: str) -> Req:
    return Req(rid, [1], SamplingParams.from_dict({"regex": regex}), 0, frozenset())


def hogged(c: GrammarCompiler, calls: list[str]) -> None:
    """Occupies c's only thread (a waiter that never leaves: it runs)."""
    c.submit(("regex", "hog"))
    deadline = time.monotonic() + 5
    while "hog" not in calls and time.monotonic() < deadline:
        time.sleep(0.005)
    assert "hog" in calls


def test_an_orphan_job_never_runs_and_a_shared_one_still_does():
    gate = threading.Event()
    c, calls = counting_compiler(gate)
    mgr = GrammarManager(c, len(VOCAB))
    try:
        hogged(c, calls)
        orphan, a, b = req("o", "orphan"), req("a", "shared"), req("b", "shared")
        assert not mgr.admit(orphan) and not mgr.admit(a) and not mgr.admit(b)
        assert c.queued == 2  # identical grammars share one job
        (_, orphan_job, _), (_, shared, _), _ = mgr.compiling
        assert mgr.drop(orphan) and mgr.drop(a) and not mgr.drop(a)
        assert c.queued == 1 and orphan_job.future.cancelled() and shared.waiters == 1
    finally:
        gate.set()
    deadline = time.monotonic() + 5
    while mgr.compiling and time.monotonic() < deadline:
        ready, failed = mgr.poll()
        time.sleep(0.005)
    assert ready == [b] and not failed and b.grammar is not None
    assert calls == ["hog", "shared"]  # the orphan never compiled
    assert c.queued == 0 and shared.waiters == 0
    assert c.check(("regex", "orphan")) is not None  # a dropped job is not kept: asked again, it compiles
    c.shutdown()


def test_a_storm_of_abandoned_grammars_leaves_a_benign_one_unblocked():
    """64 distinct slow grammars: 32 waiting in the gateway whose clients leave (their tasks cancelled),
    32 waiting in the scheduler until their queue wait passes (busy). Before, all 64 compiled one after
    another (~10 s here) and kept a benign grammar at 503; now only those a thread had started do."""
    c, calls = counting_compiler(threading.Event(), slow_s=0.15, timeout_s=0.2)
    c.queue_wait_s = 0.3
    mgr = GrammarManager(c, len(VOCAB))
    sched = [req(f"s{i}", f"slow{i}") for i in range(32)]
    assert not any(mgr.admit(r) for r in sched)

    async def gateway_storm() -> list:
        tasks = [asyncio.create_task(c.check_async(("regex", f"slow{32 + i}"))) for i in range(32)]
        await asyncio.sleep(0.02)
        assert c.queued >= 60
        for t in tasks:
            t.cancel()  # the clients left
        return await asyncio.gather(*tasks, return_exceptions=True)

    gone = asyncio.run(gateway_storm())
    assert all(isinstance(g, asyncio.CancelledError) for g in gone)
    assert c.queued <= 31  # the gateway's waiters left: their jobs are gone
    time.sleep(0.35)
    ready, failed = mgr.poll()  # the queued ones are busy now; one started may still be compiling
    deadline = time.monotonic() + 2
    while mgr.compiling and time.monotonic() < deadline:
        time.sleep(0.01)
        more = mgr.poll()
        ready, failed = ready + more[0], failed + more[1]
    assert len(ready) + len(failed) == 32 and not mgr.compiling
    assert any(r.finish_reason.code == GRAMMAR_BUSY for r in failed)
    assert c.queued == 0
    t0 = time.monotonic()
    assert c.check(("regex", "[0-9]+")) is not None  # no GrammarBusyError: at most one slow compile ahead
    assert time.monotonic() - t0 < 1.0
    assert len([t for t in calls if t.startswith("slow")]) <= 6, calls
    c.shutdown()


async def test_requests_that_leave_while_their_grammar_waits_drop_its_compile(tiny_llama, monkeypatch):
    """Engine level: one request aborted, one whose client went away (its stream cancelled), both queued
    behind compiles that hold both threads: both leave their jobs, which never run; the engine then serves a
    grammar at once."""
    from runtime import Engine
    from runtime.messages import GenerateRequest

    engine = Engine(str(tiny_llama), device="cpu", dtype="float32", max_total_tokens=512, log_level="warning")
    gate = threading.Event()
    try:
        g = engine.grammar
        calls = recorded_compiles(g, gate, monkeypatch)
        hogs = [g.submit(("regex", f"hog{i}")) for i in range(2)]  # the engine's 2 compile threads

        async def drain(rid: str) -> list:
            req = GenerateRequest(rid=rid, input_ids=[5, 6, 7], sampling_params=SamplingParams(regex=rid, max_new_tokens=4))
            return [o async for o in engine.stream(req)]

        aborted, gone = asyncio.create_task(drain("orphan0")), asyncio.create_task(drain("orphan1"))
        deadline = time.monotonic() + 5
        while (g.queued < 2 or len(calls) < 2) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert g.queued == 2 and len(engine.scheduler.grammars.compiling) == 2
        await engine.abort("orphan0")
        gone.cancel()  # the client disconnected: Engine.stream aborts its request
        outs = await asyncio.wait_for(aborted, 5)
        assert outs[-1].finished and outs[-1].finish_reason.kind == "abort"
        while (g.queued or engine.scheduler.grammars.compiling) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert g.queued == 0 and not engine.scheduler.grammars.compiling
        gate.set()
        for job in hogs:
            g.leave(job)
        out = await engine.async_generate(input_ids=[5, 6, 7], sampling_params={"regex": "[0-9]{2}", "temperature": 0})
        assert len(out["text"]) == 2 and out["text"].isdigit()
        assert not any(t.startswith("orphan") for t in calls), calls
    finally:
        gate.set()
        engine.shutdown()
