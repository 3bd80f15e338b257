"""ForwardModeStats: batches and tokens per ForwardMode, retractions, how much of max_new_tokens finished
requests used, and the periodic log line."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from runtime.messages import ModeStats
from runtime.model_executor.forward_mode import ForwardMode

if TYPE_CHECKING:
    from runtime.managers.req import Req

logger = logging.getLogger("shoal.scheduler")


class ForwardModeStats:
    def __init__(self, log_interval_s: float = 10.0):
        self.modes: dict[str, ModeStats] = {m.name: ModeStats() for m in ForwardMode}
        self.retractions = 0
        self.generated_tokens = 0
        # Requests that could stop early (EOS, stop ids or strings, a grammar) and ended by stop or length:
        # how many, their output and their max_new_tokens (admission scales open requests' remaining output).
        self.open_reqs = self.open_output = self.open_max_new = 0
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()
        self._tokens_at_last_log = 0

    def record(self, mode: ForwardMode, num_tokens: int, forward_s: float = 0.0) -> None:
        s = self.modes[mode.name]
        s.batches += 1
        s.tokens += num_tokens
        s.time_s += forward_s

    def finished(self, r: Req) -> None:
        """A request ended. Aborts and errors say nothing about how long the model writes: not counted;
        nor are requests only their length could end (they use all of max_new_tokens by definition)."""
        if r.length_known or r.finish_reason is None or r.finish_reason.kind not in ("stop", "length"):
            return
        self.open_reqs += 1
        self.open_output += len(r.output_ids)
        self.open_max_new += r.params.max_new_tokens

    def admission_fields(self, running: Iterable[Req], waiting: Iterable[Req],
                         expected_new: Callable[[Req], float]) -> dict[str, int]:
        """SchedulerStats' fields the gateway's wait estimate reads: output still to come, split by whether
        only the length can end it; the KV the engine holds back for it (expected_new: Retractor's, which
        sets how many run at once); the finished requests' use of max_new_tokens."""
        rem = rem_known = wait = wait_known = 0
        reserved = wait_reserved = 0.0
        for r in running:
            rem += r.max_new_remaining
            rem_known += r.max_new_remaining if r.length_known else 0
            reserved += expected_new(r)
        for r in waiting:
            wait += r.max_new_remaining
            wait_known += r.max_new_remaining if r.length_known else 0
            wait_reserved += expected_new(r)
        return dict(remaining_decode_tokens=rem, remaining_known_decode_tokens=rem_known,
                    waiting_decode_tokens=wait, waiting_known_decode_tokens=wait_known,
                    reserved_decode_tokens=round(reserved), waiting_reserved_decode_tokens=round(wait_reserved),
                    finished_open_reqs=self.open_reqs, finished_open_output_tokens=self.open_output,
                    finished_open_max_new_tokens=self.open_max_new)

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
