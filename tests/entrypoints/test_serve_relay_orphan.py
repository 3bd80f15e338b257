"""A Ray Serve replica's relayed stream whose client went away with Serve's proxy (`serve shutdown` kills the
proxy at once, and Serve's `receive` then raises ActorDiedError): the relay ends quietly, the request is
aborted (its KV freed) and a burst of such streams is said in one line. Before, each stream failed in
Serve with a ~40-line traceback, one a second."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

pytest.importorskip("ray.serve")

from runtime.entrypoints.ray_serve import OrphanReport, RelayResponse, drain_grace_s  # noqa: E402


def test_a_stream_orphaned_by_the_proxy_is_aborted_quietly(tiny_llama):
    import aiohttp

    from runtime import Engine
    from runtime.config import ServerArgs
    from runtime.gateway.server import serve_in_thread

    args = ServerArgs(model_path=str(tiny_llama), device="cpu", max_total_tokens=60000, context_length=60000)
    body = {"prompt": "Once upon a time", "max_tokens": 50000, "ignore_eos": True, "stream": True}

    async def relay_until_the_proxy_dies(url: str) -> tuple[list[dict], OrphanReport]:
        report, sent, flowing = OrphanReport(), [], asyncio.Event()

        async def send(message: dict) -> None:
            sent.append(message)
            if len(sent) > 5:
                flowing.set()

        async def receive() -> dict:  # Serve's proxy, killed while the stream flows
            await flowing.wait()
            raise ConnectionError("The actor died unexpectedly before finishing this task.")

        async with aiohttp.ClientSession() as session:
            upstream = await session.post(url + "/v1/completions", json=body)
            await RelayResponse(upstream, {}, report.add)({"type": "http"}, receive, send)  # returns, no raise
        return sent, report

    with Engine(server_args=args) as engine, serve_in_thread(engine, args, port=0) as gateway:
        sent, report = asyncio.run(relay_until_the_proxy_dies(gateway.url))
        deadline = time.monotonic() + 10
        while engine.get_stats().num_running_reqs or engine.get_stats().kv_usage_ratio:
            assert time.monotonic() < deadline, engine.get_stats()  # the gateway saw its client leave and aborted
            time.sleep(0.05)
    assert sent[0]["type"] == "http.response.start" and any(b"data: " in m.get("body", b"") for m in sent)
    assert report.count == 1
    said: list[str] = []
    log, handler = logging.getLogger("runtime.entrypoints.ray_serve"), logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # whether or not "runtime" propagates
    log.addHandler(handler)
    try:
        report.report()
        report.report()  # nothing new: no second line
    finally:
        log.removeHandler(handler)
    assert said == ["aborted 1 stream(s) whose client is gone: Serve's proxy stopped (ConnectionError)"]


def test_drain_grace_outside_a_replica_is_the_default_budget_less_the_reserve():
    from runtime.entrypoints.ray_serve import GRACEFUL_SHUTDOWN_TIMEOUT_S, TEARDOWN_RESERVE_S

    assert drain_grace_s() == GRACEFUL_SHUTDOWN_TIMEOUT_S - TEARDOWN_RESERVE_S == 25.0
