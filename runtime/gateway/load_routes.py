"""Load routes: how busy this server is, in vLLM's and SGLang's shapes, for the routers and load balancers
that poll them (vLLM's production stack, SGLang's router) instead of scraping /metrics.

GET /load, vLLM's: {"server_load": N}, N the HTTP requests in flight on the routes that run the model (the
generation and pooling routes, /generate included: those GatewayState.track holds, from their admission
until their answer, a stream's last event included, is sent). vLLM counts them under
--enable-server-load-tracking, from its handler's start (before tokenizing); without the flag its route is
still there and answers 0, as here.

GET /get_load, SGLang's: a list, one entry per replica (SGLang's DP rank) that is up: dp_rank, num_reqs
(running + waiting), num_waiting_reqs, num_tokens (KV slots held by running requests + prompt tokens still
to prefill: SGLang's num_total_tokens), num_pending_tokens (those prompt tokens alone) and ts_tic
(time.perf_counter() as answered). From the engine's stats, so a 503 engine_not_ready while the engine is not
ready, and while no replica is up (an empty list would read as an idle server to a router)."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from runtime.errors import ShoalError
from runtime.gateway.errors import ApiError, from_shoal_error
from runtime.gateway.protocol import encode
from runtime.gateway.state import STATE_KEY, GatewayState
from runtime.messages import SchedulerStats


class ServerLoad(msgspec.Struct):
    server_load: int


class ReplicaLoad(msgspec.Struct):
    dp_rank: int
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int
    num_pending_tokens: int
    ts_tic: float


def load_tracking(state: GatewayState) -> bool:
    # getattr: ServerArgs.enable_server_load_tracking is being added alongside.
    return bool(getattr(state.args, "enable_server_load_tracking", False))


def server_load(state: GatewayState) -> int:
    """vLLM's server_load: requests in flight on the model's routes (0 while tracking is off)."""
    return len(state.inflight) if load_tracking(state) else 0


async def load(request: web.Request) -> web.Response:
    return web.Response(body=encode(ServerLoad(server_load(request.app[STATE_KEY]))),
                        content_type="application/json")


def replica_load(rank: int, s: SchedulerStats, now: float) -> ReplicaLoad:
    return ReplicaLoad(dp_rank=rank, num_reqs=s.num_running_reqs + s.num_queue_reqs,
                       num_waiting_reqs=s.num_queue_reqs, num_tokens=s.num_used_tokens + s.waiting_tokens,
                       num_pending_tokens=s.waiting_tokens, ts_tic=now)


async def get_load(request: web.Request) -> web.Response:
    client = request.app[STATE_KEY].client()
    per_replica = getattr(client, "replica_stats", None)  # the Ray client's: one per replica / DP rank, None if down
    try:
        replicas = list(await per_replica()) if callable(per_replica) else [await client.stats()]
    except ShoalError as e:
        raise from_shoal_error(e) from None
    now = time.perf_counter()
    up = [replica_load(i, s, now) for i, s in enumerate(replicas) if s is not None]
    if not up:
        raise ApiError(503, f"not ready: none of the {len(replicas)} replicas is up", code="engine_not_ready")
    return web.Response(body=encode(up), content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/load", load)
    app.router.add_get("/get_load", get_load)
