"""Engine health (runtime/managers/step_health.py): a step that meets a sticky CUDA error, or steps failing
three times in a row, make the in-process engine unhealthy for good. GET /health then answers 503
{"status": "unhealthy", "reason"} (200 before), /health_generate 503, new requests a 503 naming the reason
(EngineUnhealthyError from the Python API; one validated before ends with that error without reaching a step),
and a SchedulerActor over that host answers unhealthy with the same reason (its Ray client then relaunches the
replica). A failure or two followed by a good step (HF's tokens) leave it healthy with the count reset."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from runtime.config import ServerArgs
from runtime.engine_client import EngineHealth, EngineUnhealthyError
from runtime.errors import EngineUnavailableError
from runtime.managers.step_health import StepHealth, is_fatal

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]
N = 6
GREEDY = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}
STICKY = "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported"


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


def test_which_errors_are_fatal():
    assert is_fatal(RuntimeError(STICKY))
    assert is_fatal(torch.AcceleratorError("CUDA error: unspecified launch failure"))
    assert is_fatal(RuntimeError("CUDA error: device-side assert triggered"))
    # a TP rank's failure as the leader reports it, and an error wrapping one (Ray's cause, raise ... from)
    assert is_fatal(EngineUnavailableError(f"TP worker rank 1 of replica 0 failed: RuntimeError: {STICKY}"))
    assert is_fatal(_wrapped(RuntimeError(STICKY)))
    ray_like = RuntimeError("ray task failed")
    ray_like.cause = RuntimeError(STICKY)
    assert is_fatal(ray_like)
    # the allocator recovers from out of memory; a plain bug is one batch's
    assert not is_fatal(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_fatal(RuntimeError("CUDA error: out of memory"))
    assert not is_fatal(ValueError("index 7 is out of bounds"))


def _wrapped(inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except RuntimeError as e:
            raise ValueError("the step failed") from e
    except ValueError as outer:
        return outer


def test_step_health_counts_failures_in_a_row():
    h = StepHealth(limit=3)
    for _ in range(2):
        assert h.failed(ValueError("boom")) == EngineHealth()
    h.succeeded()  # a good step: the count starts again
    assert h.failed(ValueError("boom")).healthy and h.failed(ValueError("boom")).healthy
    down = h.failed(ValueError("boom\nmore"))
    assert not down.healthy and down.reason == "3 scheduler steps failed in a row, the last with ValueError: boom"
    h.succeeded()  # for good: only a restart clears it
    assert h.state == down
    with pytest.raises(EngineUnhealthyError) as e:
        h.check()
    assert e.value.reason == down.reason and str(e.value) == f"the engine is unhealthy: {down.reason}"


async def test_a_sticky_cuda_error_makes_the_engine_unhealthy(make_engine, tiny_llama, monkeypatch):
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.cluster.scheduler_actor import SchedulerActor
    from runtime.gateway.app import build_app

    engine = make_engine(tiny_llama)
    early = engine.make_request(input_ids=PROMPT, sampling_params=GREEDY)  # validated while healthy
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0}
    async with TestClient(TestServer(build_app(engine, engine.args))) as http:
        r = await http.get("/health")
        assert r.status == 200 and await r.json() == {"status": "ok"}
        switch = break_worker(engine, monkeypatch, STICKY)
        r = await http.post("/v1/completions", json=body)
        assert r.status == 500 and "illegal memory access" in (await r.json())["error"]["message"]

        reason = ("a scheduler step met a device error no later step recovers from (RuntimeError: CUDA error: "
                  "an illegal memory access was encountered)")
        r = await http.get("/health")
        assert r.status == 503 and await r.json() == {"status": "unhealthy", "reason": reason}
        r = await http.post("/v1/completions", json=body)
        assert r.status == 503 and reason in (await r.json())["error"]["message"]
        r = await http.get("/health_generate")
        assert r.status == 503 and reason in (await r.json())["error"]["message"]
    assert engine.health() == EngineHealth(healthy=False, reason=reason)

    with pytest.raises(EngineUnhealthyError, match="illegal memory access"):
        await asyncio.to_thread(engine.generate, input_ids=PROMPT, sampling_params=GREEDY)
    outs = [o async for o in engine.stream(early)]  # validated before: refused by the scheduler, not stepped
    assert outs[-1].finish_reason.kind == "error" and reason in outs[-1].finish_reason.message
    assert switch["calls"] == 1  # only the first request ever reached the worker

    actor = SchedulerActor(ServerArgs(), "/m", SimpleNamespace(rank=0))  # what the Ray client hears of it
    actor.host = engine.host
    poll = actor._answer("client", None)
    assert not actor.healthy() and not await actor.health() and not poll.healthy and poll.error == reason


def test_failing_steps_in_a_row_make_it_unhealthy_and_a_good_step_resets_the_count(make_engine, tiny_llama,
                                                                                       monkeypatch, hf_greedy):
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
    assert engine.health() == EngineHealth(
        healthy=False, reason="3 scheduler steps failed in a row, the last with RuntimeError: injected failure")
    switch["on"] = False  # the worker would work again, but a broken engine is not trusted: restart it
    with pytest.raises(EngineUnhealthyError, match="3 scheduler steps failed in a row"):
        generate()
    assert switch["calls"] == 5
