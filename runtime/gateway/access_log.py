"""AccessLog: one line per HTTP request once it is answered (streams: once they end), on logger
`shoal.access` at INFO, as uvicorn's access log in vLLM, on by default:

    127.0.0.1 "POST /v1/chat/completions HTTP/1.1" 200 1f0c... 532.4 ms

the status (499, nginx's: the client went away first: before a whole answer was written, or before a
stream's last event), the request's id and the time to the answer's last byte (the middleware writes a whole
answer itself, to time that). The id is the X-Request-Id the answer carried (app.py), the one id a client
can match for every request, GETs and errors included: its own header, else the id its response id was
made from (chatcmpl-1f0c... answers 1f0c...); where no answer went out (the client left first), its header
or that id as the answer would have carried it, else '-'. Only an id of a client id's form
(request_ids.py) is printed, so a caller cannot forge fields or lines with it. The engine's rids of the
request's choices (chatcmpl-1f0c...-0) are the request log's (request_log.py). --disable-access-log (vLLM:
--disable-uvicorn-access-log) turns it off, and vLLM's --disable-access-log-for-endpoints /health,/metrics
leaves those paths out.

Its middleware is the outermost: it also opens the Exchange, the record of one HTTP request that the
request log (request_log.py) notes the prompts it logged on, to log each once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

from aiohttp import web

from runtime.config import ServerArgs
from runtime.gateway.http_site import ROOT_PATH_KEY
from runtime.gateway.request_ids import well_formed_id
from runtime.gateway.sse import is_disconnected, stream_ended
from runtime.http_flags import quiet_paths

logger = logging.getLogger("shoal.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RequestId = Callable[[web.Request], str | None]  # the X-Request-Id a request's answer carries (app.py)
CLIENT_GONE = 499  # nginx's code for a request whose client closed the connection before the answer


class Exchange:
    """One HTTP request, as its handler (and the tasks it starts) sees it: the prompts the request log logged."""

    __slots__ = ("prompts",)

    def __init__(self) -> None:
        self.prompts: list[tuple[int, ...]] = []  # the prompts already logged (--enable-log-requests)


# The handler's own request (aiohttp runs each in its task, and tasks copy it): made once, at import, as
# Python asks, and holding nothing between requests.
_CURRENT: ContextVar[Exchange | None] = ContextVar("shoal_exchange", default=None)


def current_exchange() -> Exchange | None:
    """The HTTP request being handled here; None outside a handler."""
    return _CURRENT.get()


class AccessLog:
    def __init__(self, args: ServerArgs, request_id: RequestId):
        self.enabled = not args.disable_access_log
        self.quiet = quiet_paths(args.disable_access_log_for_endpoints)
        self.request_id = request_id

    def middleware(self) -> Callable:
        @web.middleware
        async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
            exchange, start = Exchange(), time.perf_counter()
            token = _CURRENT.set(exchange)
            status = 500  # an exception the inner middleware did not turn into an answer
            try:
                response = await handler(request)
                status = await _written(request, response)
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
                    self._log(request, status, self.request_id(request), time.perf_counter() - start)

        return access_log

    def _quiet(self, request: web.Request) -> bool:
        if not self.quiet:
            return False
        root, path = request.app.get(ROOT_PATH_KEY, ""), request.path
        path = path[len(root):] if root and path.startswith(root + "/") else path
        return (path.rstrip("/") or "/") in self.quiet

    @staticmethod
    def _log(request: web.Request, status: int, request_id: str | None, elapsed_s: float) -> None:
        rid = request_id if request_id and well_formed_id(request_id) else "-"
        version = f"{request.version.major}.{request.version.minor}"
        logger.info('%s "%s %s HTTP/%s" %d %s %.1f ms', request.remote or "-", request.method, request.path_qs,
                    version, status, rid, elapsed_s * 1000)


async def _written(request: web.Request, response: web.StreamResponse) -> int:
    """The status the client got: response's once the whole answer is written (here for an answer the handler
    left unsent, as aiohttp would write it right after, so the line comes after its last byte), else 499: the
    client left before it, or before a stream's last event (a 503 or a cut stream to the handler)."""
    if response.prepared:  # a stream: the handler wrote it
        return response.status if stream_ended(response) is not False else CLIENT_GONE
    if is_disconnected(request):
        return CLIENT_GONE
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionError:  # aiohttp's write_eof after this one finds the same and gives up quietly
        return CLIENT_GONE
    return response.status
