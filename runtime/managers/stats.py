"""ForwardModeStats: batches and tokens per ForwardMode, the tokens of each engine step (vLLM's
iteration_tokens histogram), retractions, how much of max_new_tokens finished requests used, and the periodic
log line."""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from runtime.messages import ITERATION_TOKEN_BOUNDS, ModeStats
from runtime.model_executor.forward_mode import ForwardMode

if TYPE_CHECKING:
    from runtime.managers.req import Req

logger = logging.getLogger("shoal.scheduler")


class ForwardModeStats:
    def __init__(self, log_interval_s: float = 10.0):
        self.modes: dict[str, ModeStats] = {m.name: ModeStats() for m in ForwardMode}
        self.retractions = 0
        self.generated_tokens = 0
        # Engine steps by tokens: one count per bound of ITERATION_TOKEN_BOUNDS (tokens <= it, above the
        # previous one), then past the last; and their tokens.
        self.iteration_tokens = [0] * (len(ITERATION_TOKEN_BOUNDS) + 1)
        self.iteration_tokens_sum = 0
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
        # A step of the target model is one of vLLM's engine steps; a DP rank's IDLE batch runs no tokens,
        # and the draft model's DRAFT_EXTEND is recorded beside its TARGET_VERIFY step, not as a step.
        if not (mode.is_idle() or mode.is_draft_extend()):
            self.iteration_tokens[bisect_left(ITERATION_TOKEN_BOUNDS, num_tokens)] += 1
            self.iteration_tokens_sum += num_tokens

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

    def iteration_fields(self) -> dict[str, list[int] | int]:
        """SchedulerStats' fields of the tokens per engine step (copied: the snapshot leaves this thread)."""
        return dict(iteration_tokens=list(self.iteration_tokens), iteration_tokens_sum=self.iteration_tokens_sum)

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
