"""ForwardModeStats: batches and tokens per ForwardMode, retractions, and the periodic log line."""

from __future__ import annotations

import logging
import time

from runtime.messages import ModeStats
from runtime.model_executor.forward_mode import ForwardMode

logger = logging.getLogger("shoal.scheduler")


class ForwardModeStats:
    def __init__(self, log_interval_s: float = 10.0):
        self.modes: dict[str, ModeStats] = {m.name: ModeStats() for m in ForwardMode}
        self.retractions = 0
        self.generated_tokens = 0
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()
        self._tokens_at_last_log = 0

    def record(self, mode: ForwardMode, num_tokens: int, forward_s: float = 0.0) -> None:
        s = self.modes[mode.name]
        s.batches += 1
        s.tokens += num_tokens
        s.time_s += forward_s

    def snapshot(self) -> dict[str, ModeStats]:
        return {k: ModeStats(v.batches, v.tokens, v.time_s) for k, v in self.modes.items()}

    def due(self) -> bool:
        return time.monotonic() - self._last_log >= self.log_interval_s

    def log(self, mode: ForwardMode, running: int, queued: int, used: int, total: int, cached: int) -> float:
        """Logs the periodic line; returns the generation throughput since the last one (tok/s)."""
        now = time.monotonic()
        tput = (self.generated_tokens - self._tokens_at_last_log) / (now - self._last_log)
        self._last_log, self._tokens_at_last_log = now, self.generated_tokens
        logger.info("%s batch. #running-req: %d, #queue-req: %d, #token: %d, token usage: %.2f, "
                    "cache: %d, gen throughput (token/s): %.2f, #retracted: %d",
                    mode.name.capitalize(), running, queued, used, used / max(total, 1), cached, tput,
                    self.retractions)
        return tput
