"""SocketGuard: what keeps idle or hostile connections from taking the HTTP server down (server.py installs it
on every gateway loop: `shoal serve`'s and serve_in_thread's, which the Ray gateway actor runs).

- The open-file soft limit is raised to the hard limit at start (vLLM's and SGLang's set_ulimit raise it
  to 65535): every connection is a file descriptor, and a 1024 default runs out under ordinary load.
- A connection that sends no complete request head within --timeout-keep-alive seconds is closed, as one
  idle that long between requests is (aiohttp arms that timer when the connection opens and only disarms
  it once a full head has arrived, so a client trickling a header byte by byte is cut at the same time:
  uvicorn's timeout_keep_alive, 5 s in vLLM and SGLang). Without it (aiohttp's AppRunner default: an hour)
  3000 sockets that each sent half a request head held their descriptors until the limit was reached.
- At the limit, asyncio's accept loop reports "socket.accept() out of system resource" with a traceback on
  every retry; those are counted and logged as one line every LOG_EVERY_S seconds. Requests the HTTP
  parser refuses before any route runs (a header line over 8190 bytes, a bad method, a Content-Encoding it
  cannot decode) are logged the same way, one line without a traceback: a client must not be able to fill
  the disk with log."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

logger = logging.getLogger("shoal.gateway")

LOG_EVERY_S = 10.0
_FD_FALLBACK = 65535  # vLLM's and SGLang's target, tried where the hard limit itself is refused
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def raise_open_file_limit() -> int:
    """Raises RLIMIT_NOFILE's soft limit to 65535 (vLLM's and SGLang's target), or the hard limit where that is
    lower; the soft limit in force after. Never lowers it; a refusal is a warning. Not to the hard limit itself:
    a container's can be ~1e9, which children inherit and code that closes every fd up to it then stalls on."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = _FD_FALLBACK if hard == resource.RLIM_INFINITY else min(hard, _FD_FALLBACK)
    error: Exception | None = None
    for target in dict.fromkeys((ceiling, min(ceiling, _FD_FALLBACK))):
        if target <= soft:
            return soft
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError) as e:  # a hard limit past fs.nr_open, a sandbox
            error = e
    logger.warning("could not raise the open-file limit above %d (%s): connections past it are refused; raise "
                   "it with `ulimit -n`", soft, error)
    return soft


class _Throttle:
    """Counts events and lets one through every interval_s seconds, with the count of those held back."""

    def __init__(self, interval_s: float, clock: Callable[[], float]):
        self.interval_s, self._clock = interval_s, clock
        self._next, self.held = 0.0, 0

    def due(self) -> bool:
        now = self._clock()
        if now < self._next:
            self.held += 1
            return False
        self._next = now + self.interval_s
        return True

    def take_held(self) -> int:
        held, self.held = self.held, 0
        return held


class SocketGuard:
    def __init__(self, interval_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self._accepts = _Throttle(interval_s, clock)
        self._parser = _ParserErrors(_Throttle(interval_s, clock))

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Raises the file limit, and routes this loop's accept failures and aiohttp's parser errors through
        the throttled logs. Call on the loop that serves (once per server; a second guard is not added to
        aiohttp's logger)."""
        raise_open_file_limit()
        previous = loop.get_exception_handler()

        def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if not self.accept_error(context):
                (previous or (lambda _loop, ctx: loop.default_exception_handler(ctx)))(loop, context)

        loop.set_exception_handler(handle)
        server_log = logging.getLogger("aiohttp.server")
        if not any(isinstance(f, _ParserErrors) for f in server_log.filters):
            server_log.addFilter(self._parser)

    def accept_error(self, context: dict[str, Any]) -> bool:
        """Whether context is an accept failure for lack of descriptors or memory (then logged, throttled)."""
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in _OUT_OF_RESOURCES) and \
                "socket.accept() out of system resource" not in str(context.get("message", "")):
            return False
        if self._accepts.due():
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            logger.error("cannot accept new connections: %s (%d more times since the last such line); the "
                         "process holds as many sockets as it may (open-file limit %d)", exc or context["message"],
                         self._accepts.take_held(), soft)
        return True


class _ParserErrors(logging.Filter):
    """aiohttp.server's records for a request refused before any route ran (or whose body failed to decode
    after the answer went out): one line per interval, no traceback; other records pass unchanged."""

    def __init__(self, throttle: _Throttle):
        super().__init__()
        self._throttle = throttle

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError | RequestPayloadError):
            return True
        if not self._throttle.due():
            return False
        first = str(exc).strip().splitlines()
        record.msg, record.args = "refused a malformed request: %s: %s (%d more since the last such line)", (
            type(exc).__name__, first[-1].strip() if first else "", self._throttle.take_held())
        record.exc_info, record.exc_text, record.levelno, record.levelname = None, None, logging.WARNING, "WARNING"
        return True
