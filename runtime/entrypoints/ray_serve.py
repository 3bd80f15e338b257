"""Ray Serve: the same OpenAI API behind Serve's HTTP proxy, replicas and autoscaling.

    serve run deploy/serve_config.yaml          # import_path: runtime.entrypoints.ray_serve:build_app

Each Serve replica (ShoalDeployment) holds an EngineClient — an in-process Engine when tp = dp = 1 and
use_ray is off (give the replica a GPU in ray_actor_options), else a RayEngineClient whose TP/DP actors
the replica owns — and runs the regular aiohttp gateway (runtime.gateway) on a loopback port beside it.
`__call__` relays each proxied request to that gateway and streams the answer back, so routes, errors,
SSE and metrics are exactly those of `shoal serve` — and so are admission (the gateway's), cache-aware
routing and mid-stream failover across the replica's DP ranks (its RayEngineClient's): one code path.
Serve's health check calls the gateway's /health."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ray import serve

from runtime.config import ServerArgs

logger = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade",
                        "proxy-authenticate", "proxy-authorization", "te", "trailer"})


@serve.deployment(name="ShoalDeployment", health_check_period_s=10, health_check_timeout_s=30,
                  max_ongoing_requests=256)
class ShoalDeployment:
    def __init__(self, server_args: dict[str, Any]):
        from runtime.engine import Engine
        from runtime.entrypoints.engine_factory import create_engine_client
        from runtime.gateway.server import serve_in_thread
        from runtime.gc_guard import GcGuard

        self.args = replica_args(server_args)
        self.client = create_engine_client(self.args)
        self.gateway = serve_in_thread(self.client, self.args, host="127.0.0.1", port=0)
        if not isinstance(self.client, Engine):  # an in-process Engine's scheduler host has frozen this process
            GcGuard("serve replica").start()
        self._session: Any = None

    async def _http(self) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:  # made on the replica's own event loop
            # No pool cap: aiohttp's default of 100 connections would queue requests past that silently.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                  timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response, StreamingResponse

        session = await self._http()
        url = self.gateway.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        resp = await session.request(request.method, url, data=await request.body(), headers=headers)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
        if resp.content_type == "text/event-stream":
            async def relay():
                try:
                    async for chunk in resp.content.iter_any():
                        yield chunk
                finally:  # the client went away: closing our side makes the gateway abort the request
                    resp.close()

            return StreamingResponse(relay(), status_code=resp.status, headers=out_headers)
        body = await resp.read()
        resp.release()
        return Response(body, status_code=resp.status, headers=out_headers)

    async def check_health(self) -> None:
        """Serve restarts the replica when this raises: the gateway's own /health decides."""
        session = await self._http()
        async with session.get(self.gateway.url + "/health") as resp:
            if resp.status != 200:
                raise RuntimeError(f"gateway /health answered {resp.status}: {await resp.text()}")

    def __del__(self) -> None:
        try:
            self.gateway.stop()
            self.client.shutdown()
        except Exception:  # interpreter teardown
            pass


def replica_args(server_args: dict[str, Any]) -> ServerArgs:
    """A replica's ServerArgs. tp = dp = 1 without use_ray runs the Engine inside the replica, which holds
    the GPU its ray_actor_options ask for (shoal serve would start a scheduler actor on a GPU machine, and
    that actor would need a second GPU the replica's pod does not have)."""
    args = ServerArgs.from_kwargs(**server_args)
    return args if args.uses_ray or args.in_process else dataclasses.replace(args, in_process=True)


def build_app(args: dict[str, Any] | ServerArgs | None = None) -> Any:
    """Serve application builder: `args` are ServerArgs fields (the YAML's `args:` block). Invalid ones
    raise ServerArgsError here, before any replica starts."""
    if isinstance(args, ServerArgs):
        kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)}
    else:
        kwargs = dict(args or {})
        if isinstance(kwargs.get("allowed_origins"), list):  # a YAML list, as vLLM's allowed_origins is
            kwargs["allowed_origins"] = ",".join(map(str, kwargs["allowed_origins"]))
        ServerArgs.from_kwargs(**kwargs)
    # Serve's proxy owns the address and Serve's graceful_shutdown_timeout_s the drain: said, not ignored.
    for name in ("host", "port", "shutdown_timeout_s"):
        if name in kwargs:
            logger.warning("ray_serve: args.%s has no effect under Ray Serve (the proxy's http_options and "
                           "the deployment's graceful_shutdown_timeout_s set these)", name)
    return ShoalDeployment.bind(kwargs)
