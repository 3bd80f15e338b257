"""LoopLag: how late the gateway's event loop runs what is due, sampled by a task that asks to wake every
`interval_s`. Under a flood every accepted connection, parse and answer waits its turn on the one loop
(and, in-process, on the engine's GIL): a new request, and a 429 on its way out, each wait about this
long before anything of ours sees them. The admission controller uses it as the trip's delay until
returning retries have measured that delay themselves (RetryTickets.return_delay_s)."""

from __future__ import annotations

import asyncio
import time
from collections import deque


class LoopLag:
    def __init__(self, interval_s: float = 0.05, window_s: float = 2.0):
        self.interval_s, self.window_s = interval_s, window_s
        self._samples: deque[tuple[float, float]] = deque()  # (when, lag)
        self._task: asyncio.Task | None = None

    def ensure_started(self) -> None:
        """From a coroutine on the loop to watch; a no-op once the sampler runs there."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            due = time.monotonic() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            self.observe(now, max(now - due, 0.0))

    def observe(self, now: float, lag_s: float) -> None:
        self._samples.append((now, lag_s))
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def recent_s(self, now: float | None = None) -> float:
        """The largest lag seen over the last window_s (0 before any sample)."""
        now = time.monotonic() if now is None else now
        return max((lag for t, lag in self._samples if now - t <= self.window_s), default=0.0)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
