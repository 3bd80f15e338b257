"""The relay of a Ray Serve replica (ray_serve.py) to its own gateway: the request's route below Serve's root
path, the answer's headers as a client gets them through Serve, and an SSE answer streamed chunk by chunk."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from starlette.responses import StreamingResponse

logger = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade",
                        "proxy-authenticate", "proxy-authorization", "te", "trailer"})
# The gateway's answer headers that Serve's HTTP server (uvicorn) writes again itself: relayed, each came twice.
SERVE_WRITES = frozenset({"date", "server"})
REQUEST_ID = "x-request-id"  # Serve's RequestIdMiddleware sets it on the request and echoes it on the answer


def route_path(path: str, root_path: str) -> str:
    """The request's route as the gateway knows it: `path` (the URL's, which ASGI gives whole) below the
    scope's root_path, where Serve puts its http_options.root_path and the app's route_prefix (/llm of
    /llm/v1/completions). A Starlette app routes by the same rule (get_route_path)."""
    if root_path and path.startswith(root_path) and path[len(root_path):len(root_path) + 1] in ("/", ""):
        return path[len(root_path):] or "/"
    return path


def relayed_headers(upstream: Mapping[str, str], request: Mapping[str, str]) -> dict[str, str]:
    """The gateway's answer headers a client gets through Serve: not hop-by-hop ones, not those Serve's server
    writes itself (date, server), and X-Request-Id only where Serve's middleware does not echo one. The
    gateway's is the same id: the request reached it carrying Serve's (the client's own, or one Serve made),
    and the gateway names its response by it."""
    drop = HOP_BY_HOP | SERVE_WRITES | ({REQUEST_ID} if REQUEST_ID in request else set())
    return {k: v for k, v in upstream.items() if k.lower() not in drop}


class RelayResponse(StreamingResponse):
    """The gateway's SSE answer, relayed chunk by chunk. Serve's proxy hands a client's disconnect to
    `receive`; when the proxy itself is gone (`serve shutdown` kills it at once) `receive` raises instead,
    which Starlette would let out as a failed request with a traceback, one per stream. Either way the
    client is gone: closing the gateway connection makes the gateway abort the request (its KV is freed).
    ended() is called once the relay is over, however it ended (the stream's LoRA adapter is free then)."""

    def __init__(self, upstream: Any, headers: dict[str, str], orphaned: Callable[[BaseException], None],
                 ended: Callable[[], None] | None = None):
        super().__init__(self._relay(), status_code=upstream.status, headers=headers)
        self.upstream, self.orphaned, self.ended = upstream, orphaned, ended

    async def _relay(self) -> AsyncIterator[bytes]:
        import aiohttp

        try:
            async for chunk in self.upstream.content.iter_any():
                yield chunk
        except aiohttp.ClientError as e:  # the gateway went down mid-stream (this replica is being killed)
            logger.warning("a stream from the replica's gateway broke off: %s", e)

    async def __call__(self, scope: Any, receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
        async def client_events() -> dict[str, Any]:
            try:
                return await receive()
            except Exception as e:  # noqa: BLE001 — any failure to hear from the proxy: it is gone
                self.orphaned(e)
                return {"type": "http.disconnect"}

        try:
            await super().__call__(scope, client_events, send)
        finally:
            self.upstream.close()  # the gateway aborts what still runs: the engine is done with the request
            if self.ended is not None:
                self.ended()
