"""/health_generate is open without an API key (every /health* path, as SGLang's) and its check is an engine
request outside admission control, so the check is shared (runtime/gateway/health_probe.py): callers that come
while one runs wait for it, and its result (a failure too) answers for REUSE_S after, so a flood of keyless
callers costs one engine request. A failed check, and an engine that says it is unhealthy, answer 503
engine_unhealthy, the code every other route uses."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from gw_helpers import GATEWAY_ARGS, http, slow_steps

from runtime.engine_client import EngineHealth
from runtime.gateway.health_probe import HEALTH_PROBE_KEY, HealthProbe
from runtime.gateway.server import serve_in_thread
from runtime.messages import FinishReason, RequestOutput


def _counting(engine: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the engine requests streamed, and the most at once."""
    seen, stream = {"live": 0, "peak": 0, "total": 0}, engine.stream

    async def counting(req: Any) -> AsyncIterator[Any]:
        seen["live"] += 1
        seen["total"] += 1
        seen["peak"] = max(seen["peak"], seen["live"])
        try:
            async for out in stream(req):
                yield out
        finally:
            seen["live"] -= 1

    monkeypatch.setattr(engine, "stream", counting)
    return seen


def test_a_keyless_flood_costs_one_engine_request(gw_engine, monkeypatch):
    slow_steps(gw_engine, monkeypatch, 0.3)  # the check outlives the flood's arrival
    seen = _counting(gw_engine, monkeypatch)
    args = GATEWAY_ARGS.replace(api_key=("sk-x",), max_concurrent_requests=1)
    with serve_in_thread(gw_engine, args, port=0) as server:
        statuses: list[Any] = []
        callers = [threading.Thread(target=lambda: statuses.append(http(server.url + "/health_generate")))
                   for _ in range(12)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        assert statuses == [(200, {"status": "ok"})] * 12
        assert seen == {"live": 0, "peak": 1, "total": 1}
        probe = server.app[HEALTH_PROBE_KEY]
        assert probe.checks == 1
        assert http(server.url + "/health_generate")[0] == 200 and seen["total"] == 1  # reused (< 1 s)
        probe.reuse_s = 0.0  # once it is older than that, a caller runs a new one
        assert http(server.url + "/health_generate")[0] == 200 and seen["total"] == 2


def test_failures_are_engine_unhealthy(gw_engine, monkeypatch):
    calls = []

    async def failing(req: Any) -> AsyncIterator[RequestOutput]:
        calls.append(req.rid)
        yield RequestOutput(rid=req.rid, new_token_ids=[], finished=True,
                            finish_reason=FinishReason("error", message="the device is on fire"))

    with serve_in_thread(gw_engine, GATEWAY_ARGS, port=0) as server:
        monkeypatch.setattr(gw_engine, "stream", failing)
        for _ in range(2):  # the second reuses the first's result
            status, body = http(server.url + "/health_generate")
            assert status == 503 and body["error"]["code"] == "engine_unhealthy", body
            assert body["error"]["message"] == "generation check failed: the device is on fire"
        assert len(calls) == 1 and calls[0].startswith("health-")
        monkeypatch.setattr(gw_engine, "health", lambda: EngineHealth(healthy=False, reason="steps keep failing"))
        status, body = http(server.url + "/health_generate")
        assert status == 503 and body["error"]["code"] == "engine_unhealthy", body
        assert "steps keep failing" in body["error"]["message"] and len(calls) == 1  # no check was run


def test_the_probe_shares_and_reuses():
    """Concurrent callers share a check (one that leaves does not stop it for the others); its result is
    reused for reuse_s; a check that raised is not reused; close() stops one still running."""
    async def go() -> None:
        probe, runs, gate = HealthProbe(reuse_s=0.2), [], asyncio.Event()

        async def check() -> str | None:
            runs.append(time.monotonic())
            await gate.wait()
            return "why not" if len(runs) > 1 else None

        first = asyncio.ensure_future(probe.result(check))
        others = [asyncio.ensure_future(probe.result(check)) for _ in range(3)]
        await asyncio.sleep(0.01)
        first.cancel()  # the caller that started it leaves
        gate.set()
        assert await asyncio.gather(*others) == [None] * 3 and len(runs) == 1
        assert await probe.result(check) is None and len(runs) == 1
        await asyncio.sleep(0.25)
        assert await probe.result(check) == "why not" and len(runs) == 2

        async def broken() -> str | None:
            raise RuntimeError("a bug")

        probe.reuse_s = 0.0
        for _ in range(2):
            with pytest.raises(RuntimeError):
                await probe.result(broken)
        assert probe.checks == 4
        gate.clear()
        waiting = asyncio.ensure_future(probe.result(check))
        await asyncio.sleep(0.01)
        await probe.close()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(go())
