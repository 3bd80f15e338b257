"""Engine health (runtime/managers/step_health.py, step_failure.py): a step that meets a sticky CUDA error (only those:
an invalid argument, a launch's resources, a cuBLAS status are one batch's; CUBLAS_STATUS_ALLOC_FAILED is out of
memory) makes the in-process engine unhealthy for good. GET /health then answers 503 {"status": "unhealthy",
"reason"} (200 before), /health_generate 503, new requests a 503 naming the reason (EngineUnhealthyError from the
Python API; one validated before, refused by the scheduler, a 503 engine_unhealthy too), and a SchedulerActor over
that host answers unhealthy with the same reason (its Ray client then relaunches the replica). The request in the
failing step ends with that step's error (code None: on Ray it is not moved); one that never ran in it ends with
code ENGINE_UNHEALTHY (on Ray it moves). Steps failing three times in a row make it unhealthy only when a probe
request alone in its batch fails too: one bad request retried three times (as the OpenAI SDK retries a 500)
leaves it healthy, HF's tokens after. A failure or two followed by a good step leave it healthy, count reset."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from runtime.config import ServerArgs
from runtime.engine_client import ENGINE_UNHEALTHY, EngineHealth, EngineUnhealthyError
from runtime.errors import EngineUnavailableError
from runtime.managers import step_health
from runtime.managers.step_health import StepHealth, is_fatal

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]
N = 6
GREEDY = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}
STICKY = "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported"
REASON = ("a scheduler step met a device error no later step recovers from (RuntimeError: CUDA error: an illegal "
          "memory access was encountered)")


def break_worker(engine, monkeypatch, message: str) -> dict:
    """Every worker step raises RuntimeError(message) while switch["on"]; switch["calls"] counts the failed ones."""
    real = engine.worker.run_batch
    switch = {"on": True, "calls": 0}

    def run_batch(batch):
        if switch["on"]:
            switch["calls"] += 1
            raise RuntimeError(message)
        return real(batch)

    monkeypatch.setattr(engine.worker, "run_batch", run_batch)
    return switch


def test_which_errors_are_fatal(monkeypatch):
    for text in (STICKY, "CUDA error: unspecified launch failure", "CUDA error: device-side assert triggered",
                 "CUDA error: misaligned address", "CUDA error: an illegal instruction was encountered",
                 "CUDA error: uncorrectable ECC error encountered", "CUDA error: hardware stack error"):
        assert is_fatal(RuntimeError(text)) and is_fatal(torch.AcceleratorError(text)), text
    # a TP rank's failure as the leader reports it, and an error wrapping one (Ray's cause, raise ... from)
    assert is_fatal(EngineUnavailableError(f"TP worker rank 1 of replica 0 failed: RuntimeError: {STICKY}"))
    assert is_fatal(_wrapped(RuntimeError(STICKY)))
    ray_like = RuntimeError("ray task failed")
    ray_like.cause = RuntimeError(STICKY)
    assert is_fatal(ray_like)
    # one batch's shape or parameters, and out of memory (cuBLAS's workspace too), which the allocator recovers from
    for text in ("CUDA error: invalid argument", "CUDA error: too many resources requested for launch",
                 "CUDA error: invalid configuration argument",
                 "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx(handle, ...)`",
                 "CUDA error: CUBLAS_STATUS_INVALID_VALUE when calling `cublasGemmStridedBatchedEx(handle, ...)`",
                 "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
                 "CUDA error: out of memory"):
        assert not is_fatal(RuntimeError(text)) and not is_fatal(torch.AcceleratorError(text)), text
    assert not is_fatal(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_fatal(ValueError("index 7 is out of bounds"))
    # on a CUDA device a sticky-looking error is fatal only while the device still fails (a sticky one does)
    health, device = StepHealth(), {"fails": False}
    health.device = "cuda:0"
    monkeypatch.setattr(step_health, "device_still_fails", lambda d, timeout_s: d == "cuda:0" and device["fails"])
    assert not health.fatal(RuntimeError(STICKY)) and health.failed(RuntimeError(STICKY)) is None
    device["fails"] = True
    assert health.fatal(RuntimeError(STICKY)) and not health.fatal(RuntimeError("CUDA error: invalid argument"))
    # a lost TP rank's error is that rank's device's: taken at its word, this device is not checked
    device["fails"] = False
    assert health.fatal(EngineUnavailableError(f"TP worker rank 1 of replica 0 failed: RuntimeError: {STICKY}"))


def test_the_device_check_is_bounded(monkeypatch):
    """device_still_fails runs under the scheduler's lock: a synchronize that never returns (a stream stuck in a
    collective with a dead peer) counts as a failing device after timeout_s, not a scheduler hung for good."""
    release = threading.Event()
    sync = {"mode": "ok"}

    def synchronize(device=None):
        if sync["mode"] == "raises":
            raise RuntimeError(STICKY)
        if sync["mode"] == "hangs":
            release.wait()

    monkeypatch.setattr(step_health.torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(step_health.torch.cuda, "synchronize", synchronize)
    try:
        assert not step_health.device_still_fails("cpu", 5.0)  # a working device (the tiny kernel runs)
        sync["mode"] = "raises"
        assert step_health.device_still_fails("cpu", 5.0)
        sync["mode"] = "hangs"
        start = time.monotonic()
        assert step_health.device_still_fails("cpu", 0.2)
        assert time.monotonic() - start < 2
    finally:
        release.set()


def test_a_hanging_device_check_makes_the_engine_unhealthy(make_engine, tiny_llama, monkeypatch):
    engine = make_engine(tiny_llama)
    s = engine.scheduler
    s.health.device, s.health.device_check_timeout_s = "cpu", 0.2  # as SchedulerHost sets a CUDA worker's
    release = threading.Event()
    monkeypatch.setattr(step_health.torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(step_health.torch.cuda, "synchronize", lambda device=None: release.wait())
    break_worker(engine, monkeypatch, STICKY)
    try:
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert out["finish_reason"] == "error" and "illegal memory access" in out["error"]
        engine.get_stats()  # the scheduler's lock is free again
        assert engine.health() == EngineHealth(healthy=False, reason=REASON)
    finally:
        release.set()


def _wrapped(inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except RuntimeError as e:
            raise ValueError("the step failed") from e
    except ValueError as outer:
        return outer


def test_step_health_counts_failures_and_a_probe_decides():
    h = StepHealth(limit=3)
    for _ in range(2):
        assert h.failed(ValueError("boom")) is None and not h.probe_due
    h.succeeded()  # a good step: the count starts again
    for _ in range(3):
        assert h.failed(ValueError("boom\nmore")) is None
    assert h.probe_due
    assert h.probed(None) is None and h.failed_in_a_row == 0 and not h.probe_due  # the probe passed: serving on
    for _ in range(3):
        h.failed(ValueError("boom\nmore"))
    reason = h.probed(RuntimeError("probe broke"))
    assert reason == ("3 scheduler steps failed in a row, the last with ValueError: boom, and a probe request alone "
                      "in its batch failed too (RuntimeError: probe broke)")
    assert h.state == EngineHealth()  # nothing changes until marked: the step's requests end first
    h.mark_unhealthy(reason)
    h.succeeded()  # for good: only a restart clears it
    assert h.state == EngineHealth(healthy=False, reason=reason) and not h.probe_due
    assert h.failed(RuntimeError(STICKY)) is None and h.state.reason == reason  # the first reason stays
    with pytest.raises(EngineUnhealthyError) as e:
        h.check()
    assert e.value.reason == reason and str(e.value) == f"the engine is unhealthy: {reason}"


async def test_a_sticky_cuda_error_makes_the_engine_unhealthy(make_engine, tiny_llama, monkeypatch):
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.cluster.scheduler_actor import SchedulerActor
    from runtime.gateway.app import build_app

    engine = make_engine(tiny_llama)
    s = engine.scheduler
    early = engine.make_request(input_ids=PROMPT, sampling_params=GREEDY)  # validated while healthy
    waiting = engine.make_request(input_ids=PROMPT, sampling_params=GREEDY)
    late = engine.make_request(input_ids=PROMPT, sampling_params=GREEDY)  # reaches a Ray actor once unhealthy
    seen = []  # every output the scheduler sinks
    sink = s.sink
    monkeypatch.setattr(s, "sink", lambda outs: (seen.extend(outs), sink(outs)))
    stepping, validated, calls = threading.Event(), threading.Event(), []

    def run_batch(batch):  # the first step meets the sticky error once B passed validation (still healthy)
        calls.append(batch)
        s._add(waiting)  # queued behind the failing step: it never runs in it
        stepping.set()
        assert validated.wait(10)
        raise RuntimeError(STICKY)

    real_validate = engine.validate

    def validate(req):
        req = real_validate(req)
        if stepping.is_set():
            validated.set()
        return req

    monkeypatch.setattr(engine.worker, "run_batch", run_batch)
    monkeypatch.setattr(engine, "validate", validate)
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0}
    async with TestClient(TestServer(build_app(engine, engine.args))) as http:
        r = await http.get("/health")
        assert r.status == 200 and await r.json() == {"status": "ok"}
        a = asyncio.create_task(http.post("/v1/completions", json=body))
        assert await asyncio.to_thread(stepping.wait, 10)
        rb = await http.post("/v1/completions", json=body)  # validated healthy, refused by the scheduler after
        ra = await a
        await asyncio.to_thread(engine.get_stats)  # the scheduler thread is past the failed step
        assert ra.status == 500 and "illegal memory access" in (await ra.json())["error"]["message"]
        assert rb.status == 503 and (await rb.json())["error"] == {
            "message": f"the engine is unhealthy: {REASON}", "type": "service_unavailable_error", "param": None,
            "code": "engine_unhealthy"}
        r = await http.get("/health")
        assert r.status == 503 and await r.json() == {"status": "unhealthy", "reason": REASON}
        r = await http.post("/v1/completions", json=body)
        assert r.status == 503 and (await r.json())["error"]["code"] == "engine_unhealthy"
        r = await http.get("/health_generate")
        assert r.status == 503 and REASON in (await r.json())["error"]["message"]
    assert engine.health() == EngineHealth(healthy=False, reason=REASON)
    # the request in the failing step ends with its error (on Ray: not moved); the one that never ran with the code
    ended = {o.rid: o.finish_reason for o in seen if o.finished}
    a_rid = next(rid for rid in ended if rid not in (waiting.rid, early.rid) and "illegal" in ended[rid].message)
    assert ended[a_rid].code is None and ended[a_rid].message.startswith("internal error: RuntimeError: CUDA error")
    assert ended[waiting.rid].code == ENGINE_UNHEALTHY and ended[waiting.rid].message == f"the engine is unhealthy: {REASON}"

    with pytest.raises(EngineUnhealthyError, match="illegal memory access"):
        await asyncio.to_thread(engine.generate, input_ids=PROMPT, sampling_params=GREEDY)
    outs = [o async for o in engine.stream(early)]  # validated before: refused by the scheduler, not stepped
    assert outs[-1].finish_reason.kind == "error" and outs[-1].finish_reason.code == ENGINE_UNHEALTHY
    assert outs[-1].finish_reason.message == f"the engine is unhealthy: {REASON}"
    assert len(calls) == 1  # only the first request ever reached the worker; no probe after a fatal error

    actor = SchedulerActor(ServerArgs(), "/m", SimpleNamespace(rank=0))  # what the Ray client hears of it
    actor.host = engine.host
    actor._submit(late, "client")
    poll = actor._answer("client", None)
    assert not actor.healthy() and not await actor.health() and not poll.healthy and poll.error == REASON
    assert [o.finish_reason.code for o in poll.outputs] == [ENGINE_UNHEALTHY]  # never ran: its client moves it


def test_failing_steps_and_a_failing_probe_make_it_unhealthy_and_a_good_step_resets_the_count(
        make_engine, tiny_llama, monkeypatch, hf_greedy):
    engine = make_engine(tiny_llama)
    switch = break_worker(engine, monkeypatch, "injected failure")

    def generate() -> dict:
        return engine.generate(input_ids=PROMPT, sampling_params=GREEDY)

    for _ in range(2):
        out = generate()
        assert out["finish_reason"] == "error" and "injected failure" in out["error"]
    assert engine.health().healthy and engine.scheduler.health.failed_in_a_row == 2
    switch["on"] = False
    assert generate()["output_ids"] == hf_greedy(PROMPT, N)  # a good step: still serving, count reset
    assert engine.health().healthy and engine.scheduler.health.failed_in_a_row == 0

    switch["on"] = True
    for _ in range(3):
        assert generate()["finish_reason"] == "error"
    engine.get_stats()  # on the scheduler thread: past the failed step (its probe and verdict precede its outputs)
    assert engine.health() == EngineHealth(healthy=False, reason=(
        "3 scheduler steps failed in a row, the last with RuntimeError: injected failure, and a probe request alone "
        "in its batch failed too (RuntimeError: injected failure)"))
    switch["on"] = False  # the worker would work again, but a broken engine is not trusted: restart it
    with pytest.raises(EngineUnhealthyError, match="3 scheduler steps failed in a row"):
        generate()
    assert switch["calls"] == 6  # 2, then 3 and the probe's


def test_one_bad_request_retried_leaves_the_engine_healthy(make_engine, tiny_llama, monkeypatch, hf_greedy):
    engine = make_engine(tiny_llama)
    poison = (7, 7, 7, 7)  # stands for any input whose step fails (a per-shape kernel bug, its parameters)
    real, steps = engine.worker.run_batch, []

    def run_batch(batch):
        poisoned = any(r.origin_input_ids == poison for b in engine.scheduler.stepping for r in b.reqs)
        steps.append("poison" if poisoned else len(batch.input_ids))
        if poisoned:
            raise RuntimeError("shape-specific kernel failure")
        return real(batch)

    monkeypatch.setattr(engine.worker, "run_batch", run_batch)
    for _ in range(3):  # the OpenAI SDK sends it three times: max_retries=2 on a 500
        out = engine.generate(input_ids=list(poison), sampling_params=GREEDY)
        assert out["finish_reason"] == "error" and "shape-specific kernel failure" in out["error"]
    engine.get_stats()  # past the last failure's step (its probe precedes the failure's outputs)
    assert steps == ["poison", "poison", "poison", 1]  # then a probe: one token alone in its batch, which passed
    assert engine.health() == EngineHealth() and engine.scheduler.health.failed_in_a_row == 0
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == hf_greedy(PROMPT, N)


def test_an_embedding_refused_by_an_unhealthy_engine_is_a_503_with_its_code():
    """openai_embeddings._one maps the engine's coded failure as generation.py does (not a 500)."""
    from runtime.engine_client import ENGINE_UNHEALTHY
    from runtime.gateway.errors import ApiError
    from runtime.gateway.openai_embeddings import _one
    from runtime.messages import FinishReason, GenerateRequest, RequestOutput
    from runtime.sampling.params import SamplingParams

    class Refusing:
        async def stream(self, req):
            yield RequestOutput(rid=req.rid, new_token_ids=[], finished=True, finish_reason=FinishReason(
                "error", message="the engine is unhealthy: 3 scheduler steps failed", code=ENGINE_UNHEALTHY))

    with pytest.raises(ApiError) as e:
        asyncio.run(_one(Refusing(), GenerateRequest(rid="e-0", input_ids=[1, 2], sampling_params=SamplingParams()),
                         None))
    assert e.value.status == 503 and e.value.code == ENGINE_UNHEALTHY and "unhealthy" in e.value.message
