"""GET /health and GET /health_generate: whether the engine serves (EngineClient.health, readiness, Ray
replicas up) and whether it can generate one token (a check shared by concurrent callers: health_probe.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from runtime.engine_client import EngineHealth
from runtime.errors import ShoalError
from runtime.gateway.errors import ApiError
from runtime.gateway.health_probe import HEALTH_PROBE_KEY
from runtime.gateway.protocol import encode
from runtime.gateway.state import STATE_KEY, GatewayState
from runtime.messages import GenerateRequest
from runtime.sampling.params import SamplingParams

logger = logging.getLogger("shoal.gateway")

_HEALTH_GENERATE_TIMEOUT_S = 30.0


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(obj), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """200 while the engine serves; 503 {"status": "unhealthy", "reason"} once it cannot (EngineClient.health: its
    steps keep failing or met a dead device, as vLLM's /health after EngineDeadError; on Ray, no replica left to
    serve), so a liveness probe restarts the server; 503 engine_not_ready while it starts or shuts down."""
    state = request.app[STATE_KEY]
    down = _unhealthy(state)
    if down is not None:
        return _json({"status": "unhealthy", "reason": down.reason}, status=503)
    client = state.current_client()
    if client is None:
        raise ApiError(503, "not ready: the engine is starting or shutting down", code="engine_not_ready")
    routing = client.routing_stats()
    if routing is None or not routing.alive:
        return _json({"status": "ok"})
    # Still 200 while any replica serves (a load balancer should keep sending here); the body tells a probe
    # or an operator that some replica is down or relaunching.
    up = sum(routing.alive)
    status = "ok" if up == len(routing.alive) else "degraded"
    return _json({"status": status, "replicas_up": up, "replicas": len(routing.alive)})


def _unhealthy(state: GatewayState) -> EngineHealth | None:
    """The engine's health when it says it cannot serve, asked even when it is not ready (on Ray, not ready
    means no replica is live: the reason says why); None while it can, loads, or shuts down."""
    client = None if state.shutting_down else state.provider()
    if client is None:
        return None
    try:
        health = client.health()
    except Exception:  # cannot tell: readiness decides (a false 503 would have a probe restart a good server)
        logger.warning("could not read the engine's health", exc_info=True)
        return None
    return None if health.healthy else health


async def health_generate(request: web.Request) -> web.Response:
    """Ready and able to generate: one greedy token came (an unhealthy engine answers 503 engine_unhealthy with
    its reason without one). The route is open without a key, so its check is shared (health_probe.py):
    concurrent callers wait for one, and its result answers for a second after. While generation is paused
    (/pause_generation) a probe would wait for /continue_generation, so it answers 200 without one, as
    SGLang's: a paused engine is healthy (its body says paused)."""
    state = request.app[STATE_KEY]
    down = _unhealthy(state)
    if down is not None:
        raise ApiError(503, f"generation check failed: the engine is unhealthy: {down.reason}",
                       code="engine_unhealthy")
    client = state.client()
    paused = await _paused_replicas(client)
    if paused:
        return _json({"status": "ok", "generation": "paused",
                      "message": f"generation is paused on {paused} scheduler{'s' if paused != 1 else ''} "
                                 "(/pause_generation): no probe was run; /continue_generation resumes it"})
    error = await request.app[HEALTH_PROBE_KEY].result(lambda: _one_token(state, client))
    if error is not None:
        raise ApiError(503, f"generation check failed: {error}", code="engine_unhealthy")
    return _json({"status": "ok"})


async def _one_token(state: GatewayState, client: Any) -> str | None:
    """/health_generate's check: None once one greedy token came, else why it did not."""
    async def one_token() -> str | None:
        ids = [0] if getattr(client.tokenizer, "is_null", False) else client.tokenizer.encode("ping") or [0]
        req = GenerateRequest(rid=state.new_id("health"), input_ids=ids,
                              sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
        async for out in client.stream(client.validate(req)):
            if out.finished:
                fr = out.finish_reason
                return fr.message if fr is not None and fr.kind == "error" else None
        return "the stream ended without finishing"

    try:
        return await asyncio.wait_for(one_token(), _HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return f"no token within {_HEALTH_GENERATE_TIMEOUT_S:.0f} s"
    except ShoalError as e:
        return str(e)


async def _paused_replicas(client: Any) -> int:
    """How many schedulers say they are paused (their stats); 0 when the stats cannot be read: the probe then
    finds out what is wrong."""
    try:
        stats = await client.stats()
    except Exception:
        logger.debug("could not read scheduler stats for /health_generate", exc_info=True)
        return 0
    return getattr(stats, "paused_replicas", 0)
