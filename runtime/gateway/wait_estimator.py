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
Until a rate has been measured the estimate is 0 (nothing to go on: admit).

Two things make that honest under a burst (measured on the 2-core CPU host, tiny Llama, 16k-token pool:
40 x n=16 x 490 tokens were refused at "about 3x s" after the 22nd although the 22 admitted finished
in 12.5 s):
  - A decode step costs about the same at any batch (tiny Llama on CPU: 0.58 ms at 1 sequence, 0.74 at
    4, 1.19 at 16, 2.4 at 40; a GPU's memory-bound decode likewise), so tokens per second grow almost
    with the batch: a rate measured while one curl request ran (1.7k tok/s) is 10x too slow for the
    burst's batch (16.7k). The step time is therefore kept per batch size (StepTimes: decode steps'
    wall time and tokens between snapshots, bucketed by their mean batch) and the rate is the one at
    the batch that will run while the request waits.
  - That batch is bounded by the KV pool as much as by --max-running-requests: the engine starts a
    request only when the pool can hold what it will need (its prompt and its output), so at most
    pool / (prompt + max_new_tokens) run at once (33 of 256 slots there), and the queue starts
    that many at a time, not 256."""

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
    decode_batch: float = 0.0  # the batch decode_tok_s is the rate of (0: the measured average)
    correction: float = 1.0  # wait_s is the model's times this (AdmissionController's learned scale)
    trip_s: float = 0.0  # what promises add for the HTTP trip (AdmissionController.trip_s)


# With decode steps of one batch size only, the share of a step that grows with the batch (the rest is
# fixed: weights read, kernel launches, the host's scheduling). Measured for tiny Llama on the 2-core CPU
# host: 7% for the engine's steps alone (0.55 ms + 0.04 ms x B), but in a burst of 40 n=16 requests,
# where the gateway's per-token work shares the host, t(40) / t(1) was 4.1 (a 14% share) with the host
# otherwise idle and 8.7 (20%) with its cores shared with other work. GPU decode is memory-bound: smaller.
# A second batch size, measured as soon as a burst ramps up, replaces the prior with a fit.
PER_SEQUENCE_SHARE = 0.15
MIN_BUCKET_BATCHES = 16  # a bucket's mean step time says little before this many steps
BUCKET_HALF_LIFE_BATCHES = 200.0  # a bucket forgets its old steps after this many new ones (halves them)


class StepTimes:
    """Decode step time as a function of the batch: t(B) = fixed + per_seq x B, fitted to the mean step
    time of each batch-size bucket (half octaves). Kept across idle time and across bursts: a few small
    requests do not erase what a large batch was measured to cost."""

    def __init__(self) -> None:
        self._buckets: dict[int, list[float]] = {}  # bucket → [batches, tokens, seconds], decayed
        self.fixed_s = self.per_seq_s = 0.0

    def add(self, batches: float, tokens: float, seconds: float) -> None:
        if batches <= 0 or tokens <= 0 or seconds <= 0:
            return
        key = round(2 * math.log2(max(tokens / batches, 1.0)))
        b = self._buckets.setdefault(key, [0.0, 0.0, 0.0])
        keep = 0.5 ** (batches / BUCKET_HALF_LIFE_BATCHES)
        b[0], b[1], b[2] = b[0] * keep + batches, b[1] * keep + tokens, b[2] * keep + seconds
        self._fit()

    def _fit(self) -> None:
        pts = [(tok / n, s / n) for n, tok, s in self._buckets.values() if n >= MIN_BUCKET_BATCHES]
        if not pts:
            self.fixed_s = self.per_seq_s = 0.0
            return
        lo, hi = min(b for b, _ in pts), max(b for b, _ in pts)
        if hi < 1.5 * lo:  # one batch size: the prior split
            b0, t0 = max(pts)
            self.per_seq_s = PER_SEQUENCE_SHARE * t0 / b0
            self.fixed_s = t0 - self.per_seq_s * b0
            return
        n = len(pts)
        mb, mt = sum(b for b, _ in pts) / n, sum(t for _, t in pts) / n
        var = sum((b - mb) ** 2 for b, _ in pts)
        slope = sum((b - mb) * (t - mt) for b, t in pts) / var
        if slope <= 0:  # noise: steps no slower with the batch
            self.per_seq_s, self.fixed_s = 0.0, mt
        elif mt - slope * mb < 0:  # no fixed part: through the origin
            self.per_seq_s, self.fixed_s = sum(b * t for b, t in pts) / sum(b * b for b, _ in pts), 0.0
        else:
            self.per_seq_s, self.fixed_s = slope, mt - slope * mb

    def rate(self, batch: float) -> float:
        """Decode tokens per second at this batch (0: not measured)."""
        step = self.fixed_s + self.per_seq_s * batch
        return batch / step if step > 0 else 0.0


class WaitEstimator:
    def __init__(self, window_s: float = 2.0):
        self.window_s = window_s
        self._samples: deque[tuple[float, float, float, float, float]] = deque()  # (t, pf tok, pf s, dec tok, dec s)
        self._last_decode: tuple[int, int, float] | None = None  # (batches, tokens, seconds) at the last snapshot
        self.steps = StepTimes()
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
        dec_b = sum(modes[m].batches for m in _DECODE_MODES if m in modes)
        if self._samples and (pf_tok < self._samples[-1][1] or dec_tok < self._samples[-1][3]):
            self._samples.clear()  # counters went back (a replica restarted): start the window again
            self._last_decode = None
        last = self._last_decode or (0, 0, 0.0)  # the first snapshot: the steps so far, on average
        self.steps.add(dec_b - last[0], dec_tok - last[1], dec_s - last[2])
        self._last_decode = (dec_b, dec_tok, dec_s)
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
                 extra_waiting_reqs: int = 0, new_tokens: int = 0) -> WaitEstimate:
        """The wait of one more request of prompt_tokens (and new_tokens of output, its max); extra_*:
        admitted since `stats` was taken."""
        waiting_tokens = stats.waiting_tokens + extra_waiting_tokens
        ahead = stats.num_queue_reqs + extra_waiting_reqs
        running = stats.num_running_reqs
        prefill_s = waiting_tokens / self.prefill_tok_s if self.prefill_tok_s else 0.0
        used = max(stats.num_used_tokens, 0)
        # KV one request of the queue holds by its end (the engine starts one only when the pool can hold
        # about that); the queue's mean, or this request's own when none waits.
        need = ((waiting_tokens + stats.waiting_decode_tokens) / ahead if ahead
                else prompt_tokens + new_tokens)
        # Slots: this request is number ahead + 1 in line for a place in the batch; the places free now are
        # the batch's free slots, as far as the free pool holds their requests.
        if stats.max_running_reqs:
            free_slots = max(stats.max_running_reqs - running, 0)
            if need > 0 and stats.max_total_tokens:
                free_slots = min(free_slots, max(stats.max_total_tokens - used, 0) // need)
        else:
            free_slots = ahead + 1
        batch = self._batch(stats, ahead, need)
        rate = self.steps.rate(batch) if batch else 0.0
        if not rate:  # no decode steps measured per batch size yet: the window's average
            rate, batch = self.decode_tok_s, 0.0
        slots_s = self._finish_time(stats, ahead + 1 - free_slots, rate)
        # KV: what the queue and this prompt need beyond the free pool (evictable cache counts as free:
        # it is given back on demand), freed by finishing requests that each hold used / running.
        shortfall = waiting_tokens + prompt_tokens - (stats.max_total_tokens - used)
        kv_s = (self._finish_time(stats, math.ceil(shortfall * running / used), rate)
                if shortfall > 0 and used else 0.0)
        return WaitEstimate(prefill_s + max(kv_s, slots_s), prefill_s, kv_s, slots_s, self.prefill_tok_s,
                            rate, batch)

    @staticmethod
    def _batch(stats: SchedulerStats, ahead: int, need: float) -> float:
        """The batch that decodes while the queue drains: all that run or wait, as far as the running cap
        and the pool (pool / what one request needs) allow; 0 when the engine does not say its cap."""
        if not stats.max_running_reqs:
            return 0.0
        cap = float(stats.max_running_reqs)
        if need > 0 and stats.max_total_tokens:
            cap = min(cap, max(stats.max_total_tokens / need, 1.0))
        return max(min(cap, stats.num_running_reqs + ahead + 1), 1.0)

    @staticmethod
    def _finish_time(stats: SchedulerStats, k: int, rate: float) -> float:
        """How long until k more requests have finished decoding, at `rate` decode tokens per second."""
        if k <= 0 or not rate:
            return 0.0
        running = stats.num_running_reqs
        per_queued = (stats.waiting_decode_tokens / stats.num_queue_reqs if stats.num_queue_reqs
                      else 2 * stats.remaining_decode_tokens / running if running else 0.0)
        first = min(k, running)
        drain_s = stats.remaining_decode_tokens / rate
        return drain_s * first / max(running, 1) + (k - first) * per_queued / rate
