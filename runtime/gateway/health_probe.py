"""HealthProbe: /health_generate's check (one greedy token; on an embedding server one short input), shared.
The route is open without an API key (every /health* path is, as SGLang's) and its check is an engine request
that bypasses admission control, so a flood of callers must not become a flood of engine requests: a caller
that comes while a check runs waits for that check, and a check's result (healthy, or why not) answers every
caller for REUSE_S after it ended. The route so costs at most one engine request per REUSE_S whatever calls it.

The check runs as a task of its own, in an empty context: no caller's X-Request-Id names its engine request
and no caller's access-log line takes its rid; it goes on when the caller that started it leaves (the others
still wait for it). One HealthProbe per app (HEALTH_PROBE_KEY, set by build_app)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

REUSE_S = 1.0  # a check's result answers for this long after it ended

# A check: None once the engine answered as it should, else the message of why it did not.
Check = Callable[[], Awaitable[str | None]]


class HealthProbe:
    __slots__ = ("reuse_s", "checks", "_running", "_last")

    def __init__(self, reuse_s: float = REUSE_S):
        self.reuse_s = reuse_s
        self.checks = 0  # the checks run so far (what a flood of callers cost the engine)
        self._running: asyncio.Task[str | None] | None = None
        self._last: tuple[float, str | None] | None = None  # (when the last check ended, its result)

    async def result(self, check: Check) -> str | None:
        """The result of a check that ended less than reuse_s ago, else of the one running, else of `check`,
        started now."""
        last = self._last
        if last is not None and time.monotonic() - last[0] < self.reuse_s:
            return last[1]
        if self._running is None:
            self.checks += 1
            self._running = asyncio.get_running_loop().create_task(self._run(check), context=contextvars.Context())
        return await asyncio.shield(self._running)  # a caller that leaves does not cancel the others' check

    async def _run(self, check: Check) -> str | None:
        try:
            result = await check()
            self._last = (time.monotonic(), result)
            return result
        finally:
            self._running = None  # a check that raised is not reused: the next caller runs a new one

    async def close(self) -> None:
        """Stops a check still running (the app's cleanup)."""
        task = self._running
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


HEALTH_PROBE_KEY = web.AppKey("shoal_health_probe", HealthProbe)
