"""AccessLog: one line per HTTP request once it is answered (streams: once they end), on logger
`shoal.access` at INFO, as uvicorn's access log in vLLM, on by default:

    127.0.0.1 "POST /v1/chat/completions HTTP/1.1" 200 chatcmpl-1f0c...-0 532.4 ms

the status (499: the client went away first), the request's id (its first engine request's rid, which
starts with the response id the client got; else its X-Request-Id; else '-') and the time to the answer's
last byte. --disable-access-log (vLLM: --disable-uvicorn-access-log) turns it off, and vLLM's
--disable-access-log-for-endpoints /health,/metrics leaves those paths out.

Its middleware is the outermost: it also opens the Exchange, the record of one HTTP request that the
engine's view (request_log.py) notes each engine request on."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

from aiohttp import web

from runtime.config import ServerArgs
from runtime.gateway.http_site import ROOT_PATH_KEY
from runtime.http_flags import quiet_paths

logger = logging.getLogger("shoal.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CLIENT_GONE = 499  # nginx's code for a request whose client closed the connection before the answer


class Exchange:
    """One HTTP request, as its handler (and the tasks it starts) sees it: the engine requests sent for it."""

    __slots__ = ("rids", "prompts")

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.prompts: list[tuple[int, ...]] = []  # the prompts already logged (--enable-log-requests)


# The handler's own request (aiohttp runs each in its task, and tasks copy it): made once, at import, as
# Python asks, and holding nothing between requests.
_CURRENT: ContextVar[Exchange | None] = ContextVar("shoal_exchange", default=None)


def current_exchange() -> Exchange | None:
    """The HTTP request being handled here; None outside a handler."""
    return _CURRENT.get()


class AccessLog:
    def __init__(self, args: ServerArgs):
        self.enabled = not args.disable_access_log
        self.quiet = quiet_paths(args.disable_access_log_for_endpoints)

    def middleware(self) -> Callable:
        @web.middleware
        async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
            exchange, start = Exchange(), time.perf_counter()
            token = _CURRENT.set(exchange)
            status = 500  # an exception the inner middleware did not turn into an answer
            try:
                response = await handler(request)
                status = response.status
                return response
            except web.HTTPException as e:  # a redirect the inner middleware passes on
                status = e.status
                raise
            except asyncio.CancelledError:
                status = CLIENT_GONE
                raise
            finally:
                _CURRENT.reset(token)
                if self.enabled and logger.isEnabledFor(logging.INFO) and not self._quiet(request):
                    self._log(request, status, exchange, time.perf_counter() - start)

        return access_log

    def _quiet(self, request: web.Request) -> bool:
        if not self.quiet:
            return False
        root, path = request.app.get(ROOT_PATH_KEY, ""), request.path
        path = path[len(root):] if root and path.startswith(root + "/") else path
        return (path.rstrip("/") or "/") in self.quiet

    @staticmethod
    def _log(request: web.Request, status: int, exchange: Exchange, elapsed_s: float) -> None:
        header = request.headers.get("X-Request-Id")
        rid = exchange.rids[0] if exchange.rids else header[:256] if header and header.isprintable() else "-"
        version = f"{request.version.major}.{request.version.minor}"
        logger.info('%s "%s %s HTTP/%s" %d %s %.1f ms', request.remote or "-", request.method, request.path_qs,
                    version, status, rid, elapsed_s * 1000)
