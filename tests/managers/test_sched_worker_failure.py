"""A worker that raises mid-step fails the requests in flight (finish_reason "error", no hang), leaves the
KV pool whole and uncorrupted, and the engine serves the next request exactly."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from runtime.messages import BatchResult, WorkerBatch
from runtime.model_executor.forward_mode import ForwardMode

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPT = list(range(20, 60))


def fail_once(engine, monkeypatch, when: Callable[[WorkerBatch], bool]) -> list[int]:
    """Makes the worker raise on the first batch matching `when`; returns a list that records it."""
    real = engine.worker.run_batch
    failed: list[int] = []

    def flaky(batch: WorkerBatch) -> BatchResult:
        if not failed and when(batch):
            failed.append(batch.batch_id)
            raise RuntimeError("injected worker failure")
        return real(batch)

    monkeypatch.setattr(engine.worker, "run_batch", flaky)
    return failed


def is_mode(mode: ForwardMode) -> Callable[[WorkerBatch], bool]:
    return lambda b: b.forward_mode == mode


@pytest.fixture(scope="module")
def expected(tiny_llama) -> dict[str, list[int]]:
    from runtime import Engine

    with Engine(str(tiny_llama), device="cpu", max_total_tokens=4096, disable_radix_cache=True,
                log_level="warning") as e:
        return {"prompt": e.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"],
                "other": e.generate(input_ids=PROMPT[5:], sampling_params=GREEDY)["output_ids"]}


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["cache", "nocache"])
async def test_failed_step_errors_in_flight_requests(make_engine, tiny_llama, monkeypatch, pool_full, expected,
                                                     caplog, mode: ForwardMode, disable_radix_cache: bool):
    engine = make_engine(tiny_llama, disable_radix_cache=disable_radix_cache)
    failed = fail_once(engine, monkeypatch, is_mode(mode))
    with caplog.at_level(logging.ERROR, logger="runtime.managers.scheduler"):
        outs = await asyncio.wait_for(asyncio.gather(
            engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY),
            engine.async_generate(input_ids=PROMPT[5:], sampling_params=GREEDY)), 10)
    assert failed
    for o in outs:
        assert o["finish_reason"] == "error"
        assert "injected worker failure" in o["error"]
    assert "scheduler step failed" in caplog.text
    pool_full(engine)

    # The same prompts again: what the failed step never computed must not be served from the cache.
    again = engine.generate(input_ids=[PROMPT, PROMPT[5:]], sampling_params=GREEDY)
    assert [o["finish_reason"] for o in again] == ["length", "length"]
    assert again[0]["output_ids"] == expected["prompt"]
    assert again[1]["output_ids"] == expected["other"]


async def test_failure_mid_chunked_prefill(make_engine, tiny_llama, monkeypatch, pool_full, expected):
    engine = make_engine(tiny_llama, chunked_prefill_size=8)
    seen: list[int] = []

    def third_extend(b: WorkerBatch) -> bool:  # after two chunks were computed and cached
        if b.forward_mode == ForwardMode.EXTEND:
            seen.append(b.batch_id)
        return len(seen) == 3

    fail_once(engine, monkeypatch, third_extend)
    out = await asyncio.wait_for(engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY), 10)
    assert out["finish_reason"] == "error"
    pool_full(engine)
    again = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert again["output_ids"] == expected["prompt"]
    assert again["usage"]["cached_tokens"] == 16  # the two chunks that did run are reusable
