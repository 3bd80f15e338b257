"""WaitEstimator: how long a new request would wait in the scheduler queue before its prefill starts,
from the engine's real state (SchedulerStats: waiting tokens and requests, KV held, running requests
and their remaining output) and its recent rates (prefill and decode tokens per second of busy time,
from the per-ForwardMode token and time counters over a sliding window).

The engine runs one batch at a time, so a new request waits for the prompt tokens queued ahead of it to
be prefilled (waiting_tokens / prefill rate) plus, when it cannot start at once, for enough requests
to finish to make room — a free slot (the batch is at --max-running-requests) or free KV (what the
queue and its prompt need beyond the free pool). Requests finish as the batch decodes: the first
`k <= running` of them within k/running of the running set's remaining decode (remaining tokens /
decode rate), each one past that a whole queued request's decode later. Prefill and decode rates are
tokens per second of wall time while busy, measured over a sliding window, so they include what the
host costs (scheduling, the gateway's own load on an in-process engine).
Until a rate has been measured the estimate is 0 (nothing to go on: admit)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from runtime.messages import SchedulerStats

_PREFILL_MODES = ("EXTEND", "MIXED")
_DECODE_MODES = ("DECODE",)


@dataclass(frozen=True, slots=True)
class WaitEstimate:
    wait_s: float  # until the request's prefill would start
    prefill_s: float
    kv_s: float
    slots_s: float
    prefill_tok_s: float  # the rates it used (0: not measured yet)
    decode_tok_s: float
    correction: float = 1.0  # wait_s is the model's times this (AdmissionController's learned scale)
    trip_s: float = 0.0  # what promises add for the HTTP trip (AdmissionController.trip_s)


class WaitEstimator:
    def __init__(self, window_s: float = 2.0):
        self.window_s = window_s
        self._samples: deque[tuple[float, float, float, float, float]] = deque()  # (t, pf tok, pf s, dec tok, dec s)
        self.prefill_tok_s = 0.0
        self.decode_tok_s = 0.0

    def observe(self, now: float, stats: SchedulerStats) -> None:
        """Adds a stats snapshot taken at `now` and updates the rates over the window. A mode that ran
        nothing in the window keeps its last rate."""
        modes = stats.forward_modes
        pf_tok = sum(modes[m].tokens for m in _PREFILL_MODES if m in modes)
        pf_s = sum(modes[m].time_s for m in _PREFILL_MODES if m in modes)
        dec_tok = sum(modes[m].tokens for m in _DECODE_MODES if m in modes)
        dec_s = sum(modes[m].time_s for m in _DECODE_MODES if m in modes)
        if self._samples and (pf_tok < self._samples[-1][1] or dec_tok < self._samples[-1][3]):
            self._samples.clear()  # counters went back (a replica restarted): start the window again
        self._samples.append((now, pf_tok, pf_s, dec_tok, dec_s))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        first = self._samples[0]
        if first is self._samples[-1]:
            if pf_s > 0:  # one snapshot: the totals so far are the best we have
                self.prefill_tok_s = pf_tok / pf_s
            if dec_s > 0:
                self.decode_tok_s = dec_tok / dec_s
            return
        d_pf_tok, d_pf_s = pf_tok - first[1], pf_s - first[2]
        d_dec_tok, d_dec_s = dec_tok - first[3], dec_s - first[4]
        if d_pf_s > 0 and d_pf_tok > 0:
            self.prefill_tok_s = d_pf_tok / d_pf_s
        elif pf_s > 0 and not self.prefill_tok_s:
            self.prefill_tok_s = pf_tok / pf_s
        if d_dec_s > 0 and d_dec_tok > 0:
            self.decode_tok_s = d_dec_tok / d_dec_s
        elif dec_s > 0 and not self.decode_tok_s:
            self.decode_tok_s = dec_tok / dec_s

    def estimate(self, stats: SchedulerStats, prompt_tokens: int, extra_waiting_tokens: int = 0,
                 extra_waiting_reqs: int = 0) -> WaitEstimate:
        """The wait of one more request of prompt_tokens; extra_*: admitted since `stats` was taken."""
        waiting_tokens = stats.waiting_tokens + extra_waiting_tokens
        ahead = stats.num_queue_reqs + extra_waiting_reqs
        running = stats.num_running_reqs
        prefill_s = waiting_tokens / self.prefill_tok_s if self.prefill_tok_s else 0.0
        # Slots: this request is number ahead + 1 in line for a free one.
        free_slots = max(stats.max_running_reqs - running, 0) if stats.max_running_reqs else ahead + 1
        slots_s = self._finish_time(stats, ahead + 1 - free_slots)
        # KV: what the queue and this prompt need beyond the free pool (evictable cache counts as free:
        # it is given back on demand), freed by finishing requests that each hold used / running.
        used = max(stats.num_used_tokens, 0)
        shortfall = waiting_tokens + prompt_tokens - (stats.max_total_tokens - used)
        kv_s = self._finish_time(stats, math.ceil(shortfall * running / used)) if shortfall > 0 and used else 0.0
        return WaitEstimate(prefill_s + max(kv_s, slots_s), prefill_s, kv_s, slots_s, self.prefill_tok_s,
                            self.decode_tok_s)

    def _finish_time(self, stats: SchedulerStats, k: int) -> float:
        """How long until k more requests have finished decoding."""
        if k <= 0 or not self.decode_tok_s:
            return 0.0
        running = stats.num_running_reqs
        per_queued = (stats.waiting_decode_tokens / stats.num_queue_reqs if stats.num_queue_reqs
                      else 2 * stats.remaining_decode_tokens / running if running else 0.0)
        first = min(k, running)
        drain_s = stats.remaining_decode_tokens / self.decode_tok_s
        return drain_s * first / max(running, 1) + (k - first) * per_queued / self.decode_tok_s
