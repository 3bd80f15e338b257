"""Shutting the engine down ends what is in flight (no caller left waiting forever) and refuses new work."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from runtime.errors import EngineUnavailableError

LONG = {"temperature": 0, "max_new_tokens": 450, "ignore_eos": True}


async def test_shutdown_ends_in_flight_requests(make_engine, tiny_llama):
    engine = make_engine(tiny_llama)
    results: list[dict] = []
    worker = threading.Thread(target=lambda: results.append(engine.generate(input_ids=[5, 6, 7], sampling_params=LONG)),
                              daemon=True)
    worker.start()
    stream = engine.stream(engine.make_request(input_ids=[8, 9, 10], sampling_params=LONG))
    first = await anext(stream)
    assert not first.finished
    queued = engine.make_request(input_ids=[11, 12], sampling_params=LONG)

    engine.shutdown()
    worker.join(timeout=5)
    assert not worker.is_alive(), "generate() still waiting after shutdown"
    assert results[0]["finish_reason"] in ("abort", "error")
    assert len(results[0]["output_ids"]) < LONG["max_new_tokens"]
    rest = await asyncio.wait_for(_drain(stream), 5)
    assert rest[-1].finished and rest[-1].finish_reason.kind in ("abort", "error")

    assert not engine.is_ready()
    with pytest.raises(EngineUnavailableError):
        await anext(engine.stream(queued))
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailableError):
        engine.generate(input_ids=[5, 6], sampling_params=LONG)
    assert time.monotonic() - t0 < 1
    engine.shutdown()  # twice is harmless


async def _drain(stream) -> list:
    return [o async for o in stream]
