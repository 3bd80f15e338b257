"""WaitEstimator: how long a new request would wait in the scheduler queue before its prefill starts,
from the engine's real state (SchedulerStats: waiting tokens and requests, KV held, running requests
and their remaining output) and its recent rates (prefill and decode tokens per second of busy time,
from the per-ForwardMode token and time counters over a sliding window).

The engine runs one batch at a time, so a new request waits for the prompt tokens queued ahead of it to
be prefilled (waiting_tokens at the prefill step time's fit) plus, when it cannot start at once, for
enough requests to finish to make room — a free slot (the batch is at --max-running-requests) or free KV
(what the queue and its prompt need beyond the free pool). Requests finish as the batch decodes: the
first `k <= running` of them within k/running of the running set's remaining decode (remaining tokens /
decode rate), each one past that a whole queued request's decode later. Rates are per second of wall
time while busy, so they include what the host costs (scheduling, the gateway's own load on an
in-process engine). Until a rate has been measured the estimate is 0 (nothing to go on: admit).

Three things make that honest under a burst (measured on the 2-core CPU host, tiny Llama, the
in-process engine; "x" is the sum of a burst's estimated waits over the sum of its real ones):
  - A decode step costs about the same at any batch (tiny Llama on CPU: 0.58 ms at 1 sequence, 0.74 at
    4, 1.19 at 16, 2.4 at 40; a GPU's memory-bound decode likewise), so tokens per second grow almost
    with the batch: a rate measured while one curl request ran (1.7k tok/s) is 10x too slow for a
    burst's batch (16.7k). A prefill batch likewise has a fixed part (~0.6-2 ms: the weights, launches,
    the host's scheduling) beside ~8-10 us a token: single 16-token prompts measure ~20k tok/s where a
    burst's 7,000-token batches run at 80-120k. So both step times are kept per batch size (StepTimes:
    wall time between snapshots over batches, bucketed by the mean batch: sequences for decode, tokens
    for prefill) and fitted as fixed + per unit. 96 prompts of 440 tokens after single short ones: the
    window's rate said 8.3-11.5x, the prior split of one batch size 0.9-1.5x.
  - That batch is bounded by the KV pool as much as by --max-running-requests. The engine starts a
    request only when the pool, less what it holds back for the running ones' output (its new-token
    ratio, SchedulerStats.reserved_decode_tokens), holds the prompt and what it would hold back for
    it; so fewer run at once than the output they really write would allow.
  - Most requests stop (EOS, a stop string) long before max_tokens. The output still to come of a
    request that can stop early is its max_new_tokens left times the share of max_new_tokens such
    requests recently used (OutputShare, from the engine's counters of finished requests; SGLang's
    new_token_ratio is a decaying guess of the same); one only its length ends (ignore_eos and no stop,
    or a model without EOS) counts in full. Bursts of 96 requests using ~30% of max_tokens=400: 2.9-5.1x
    before, 0.9-1.5x after with 16 slots; 3.3-7.0x before, 1.2-2.1x after in a 4096-token pool."""

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
    output_share: float = 1.0  # of max_new_tokens a request that can stop early is expected to use


# With decode steps of one batch size only, the share of a step that grows with the batch (the rest is
# fixed: weights read, kernel launches, the host's scheduling). Measured for tiny Llama on the 2-core CPU
# host: 7% for the engine's steps alone (0.55 ms + 0.04 ms x B), but in a burst of 40 n=16 requests,
# where the gateway's per-token work shares the host, t(40) / t(1) was 4.1 (a 14% share) with the host
# otherwise idle and 8.7 (20%) with its cores shared with other work. GPU decode is memory-bound: smaller.
# A second batch size, measured as soon as a burst ramps up, replaces the prior with a fit.
PER_SEQUENCE_SHARE = 0.15
# With prefill batches of one size only: what the fixed part of a step is worth, in tokens. Tiny Llama on
# the 2-core CPU host: 0.64 ms + 8 us a token (80 tokens) with the host quiet, ~2.4 ms + 9.6 us (250)
# with its cores shared; a GPU reads the weights once a step against a token's compute, its roofline's
# ridge point (~300 FLOP/byte on an H100 in bf16: ~300 tokens), less at real kernels' efficiency. A low
# guess errs long (refuses rather than overfills) until a burst's batches measure a second size.
PREFILL_FIXED_TOKENS = 128.0
MIN_BUCKET_BATCHES = 16  # a decode bucket's mean step time says little before this many steps
MIN_PREFILL_BUCKET_BATCHES = 3  # a prefill batch is long enough to time well
BUCKET_HALF_LIFE_BATCHES = 200.0  # a bucket forgets its old steps after this many new ones (halves them)
# OutputShare: before any request has finished, max_new_tokens counts in full (the estimate errs long,
# which refuses rather than overfills); the prior weighs as much as this many finished requests, and
# they are forgotten (halved) after OUTPUT_HALF_LIFE_REQS newer ones. The share stays within [min, 1]:
# a few requests that stopped at once must not make a long max_tokens free.
OUTPUT_PRIOR_SHARE, OUTPUT_PRIOR_REQS, OUTPUT_HALF_LIFE_REQS, MIN_OUTPUT_SHARE = 1.0, 2.0, 100.0, 0.05


class StepTimes:
    """A step's time as a function of its batch's size x (decode: sequences; prefill: tokens):
    t(x) = fixed + per_unit x, fitted to the mean step time of each size bucket (half octaves). Kept
    across idle time and across bursts: a few small requests do not erase what a large batch cost."""

    def __init__(self, min_batches: int = MIN_BUCKET_BATCHES) -> None:
        self.min_batches = min_batches
        self._buckets: dict[int, list[float]] = {}  # bucket → [batches, units, seconds], decayed
        self.fixed_s = self.per_seq_s = 0.0  # per_seq_s: per unit of x

    def add(self, batches: float, units: float, seconds: float) -> None:
        if batches <= 0 or units <= 0 or seconds <= 0:
            return
        key = round(2 * math.log2(max(units / batches, 1.0)))
        b = self._buckets.setdefault(key, [0.0, 0.0, 0.0])
        keep = 0.5 ** (batches / BUCKET_HALF_LIFE_BATCHES)
        b[0], b[1], b[2] = b[0] * keep + batches, b[1] * keep + units, b[2] * keep + seconds
        self._fit()

    def _prior(self, x0: float, t0: float) -> tuple[float, float]:
        """(fixed, per unit) from one measured size: a step of x0 took t0."""
        per = PER_SEQUENCE_SHARE * t0 / x0
        return t0 - per * x0, per

    def _fit(self) -> None:
        pts = [(x / n, s / n) for n, x, s in self._buckets.values() if n >= self.min_batches]
        if not pts:
            self.fixed_s = self.per_seq_s = 0.0
            return
        lo, hi = min(b for b, _ in pts), max(b for b, _ in pts)
        if hi < 1.5 * lo:  # one batch size: the prior split
            self.fixed_s, self.per_seq_s = self._prior(*max(pts))
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
        if self.per_seq_s < self._min_per(*max(pts)):
            self.fixed_s, self.per_seq_s = self._prior(*max(pts))

    def _min_per(self, x0: float, t0: float) -> float:
        """The least cost a unit the fit may say, given the largest size measured (x0 took t0). Decode:
        none (a memory-bound step is about flat in the batch, and the batch is capped)."""
        return 0.0

    @property
    def measured(self) -> bool:
        return self.fixed_s + self.per_seq_s > 0

    def rate(self, batch: float) -> float:
        """Units (decode: tokens) per second at this batch (0: not measured)."""
        step = self.fixed_s + self.per_seq_s * batch
        return batch / step if step > 0 else 0.0


class PrefillTimes(StepTimes):
    def __init__(self) -> None:
        super().__init__(MIN_PREFILL_BUCKET_BATCHES)

    def _prior(self, x0: float, t0: float) -> tuple[float, float]:
        per = t0 / (x0 + PREFILL_FIXED_TOKENS)
        return per * PREFILL_FIXED_TOKENS, per

    def _min_per(self, x0: float, t0: float) -> float:
        """The prior's cost a token at the largest size measured. Small prompts' steps are about flat
        (launch-bound on a GPU; noise can tip their slope negative), and a slope of ~0 extrapolated to a
        queue of long prompts says it prefills in one step time (200k tokens: 4 ms), admitting a burst of
        them past --max-queue-wait. Once batches large enough for tokens to dominate are measured, the
        prior is close to the truth and a steeper fit keeps its slope; with a fixed part worth F tokens
        (more than PREFILL_FIXED_TOKENS) the prior errs long, by (x0 + F) / (x0 + PREFILL_FIXED_TOKENS)."""
        return self._prior(x0, t0)[1]

    def seconds(self, tokens: float) -> float:
        """Prefilling `tokens` queued prompt tokens: the engine batches what waits, so one fixed part (a
        budget-sized batch's fixed part is small beside its tokens: one is counted); 0: not measured."""
        return self.fixed_s + self.per_seq_s * tokens if tokens > 0 else 0.0


class OutputShare:
    """The share of max_new_tokens that requests able to stop early (EOS, stop strings or ids, a grammar)
    used, over the recently finished ones (token-weighted: the remaining work is a sum of tokens), from
    the engine's cumulative counters (SchedulerStats.finished_open_*) between snapshots."""

    def __init__(self) -> None:
        self._reqs = self._output = self._max_new = 0.0  # decayed sums
        self._last: tuple[int, int, int] | None = None

    def observe(self, stats: SchedulerStats) -> None:
        now = (stats.finished_open_reqs, stats.finished_open_output_tokens, stats.finished_open_max_new_tokens)
        last, self._last = self._last or (0, 0, 0), now
        if now[0] < last[0]:  # counters went back (a replica restarted): what is new is unknown
            return
        reqs, output, max_new = (a - b for a, b in zip(now, last, strict=True))
        if reqs <= 0 or max_new <= 0:
            return
        keep = 0.5 ** (reqs / OUTPUT_HALF_LIFE_REQS)
        self._reqs = self._reqs * keep + reqs
        self._output = self._output * keep + output
        self._max_new = self._max_new * keep + max_new

    @property
    def share(self) -> float:
        if not self._reqs:
            return OUTPUT_PRIOR_SHARE
        prior_tokens = OUTPUT_PRIOR_REQS * self._max_new / self._reqs  # the prior as that many mean requests
        s = (self._output + OUTPUT_PRIOR_SHARE * prior_tokens) / (self._max_new + prior_tokens)
        return min(max(s, MIN_OUTPUT_SHARE), 1.0)


@dataclass(frozen=True, slots=True)
class _Work:
    """Expected output still to come: of the running set, of the queue, of one queued request."""
    remaining: float
    waiting: float
    per_queued: float


class WaitEstimator:
    def __init__(self, window_s: float = 2.0):
        self.window_s = window_s
        self._samples: deque[tuple[float, float, float, float, float]] = deque()  # (t, pf tok, pf s, dec tok, dec s)
        self._last: tuple[int, int, float, int, int, float] | None = None  # decode, prefill (batches, tokens, s)
        self.steps = StepTimes()
        self.prefill_steps = PrefillTimes()
        self.output = OutputShare()
        self.prefill_tok_s = 0.0
        self.decode_tok_s = 0.0

    def observe(self, now: float, stats: SchedulerStats) -> None:
        """Adds a stats snapshot taken at `now` and updates the rates over the window. A mode that ran
        nothing in the window keeps its last rate."""
        modes = stats.forward_modes
        pf_tok = sum(modes[m].tokens for m in _PREFILL_MODES if m in modes)
        pf_s = sum(modes[m].time_s for m in _PREFILL_MODES if m in modes)
        pf_b = sum(modes[m].batches for m in _PREFILL_MODES if m in modes)
        dec_tok = sum(modes[m].tokens for m in _DECODE_MODES if m in modes)
        dec_s = sum(modes[m].time_s for m in _DECODE_MODES if m in modes)
        dec_b = sum(modes[m].batches for m in _DECODE_MODES if m in modes)
        if self._samples and (pf_tok < self._samples[-1][1] or dec_tok < self._samples[-1][3]):
            self._samples.clear()  # counters went back (a replica restarted): start the window again
            self._last = None
        last = self._last or (0, 0, 0.0, 0, 0, 0.0)  # the first snapshot: the steps so far, on average
        self.steps.add(dec_b - last[0], dec_tok - last[1], dec_s - last[2])
        self.prefill_steps.add(pf_b - last[3], pf_tok - last[4], pf_s - last[5])
        self._last = (dec_b, dec_tok, dec_s, pf_b, pf_tok, pf_s)
        self.output.observe(stats)
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

    def expected_output(self, max_new: float, known: float = 0.0) -> float:
        """Output tokens expected of max_new still allowed, `known` of which only the length can end."""
        return known + self.output.share * max(max_new - known, 0.0)

    def prefill_seconds(self, tokens: float) -> float:
        if self.prefill_steps.measured:
            return self.prefill_steps.seconds(tokens)
        return tokens / self.prefill_tok_s if self.prefill_tok_s else 0.0

    def estimate(self, stats: SchedulerStats, prompt_tokens: int, extra_waiting_tokens: int = 0,
                 extra_waiting_reqs: int = 0, new_tokens: int = 0, new_known: bool = False) -> WaitEstimate:
        """The wait of one more request of prompt_tokens (and new_tokens of output, its max; new_known:
        only that length ends it); extra_*: admitted since `stats` was taken."""
        waiting_tokens = stats.waiting_tokens + extra_waiting_tokens
        ahead = stats.num_queue_reqs + extra_waiting_reqs
        running = stats.num_running_reqs
        prefill_s = self.prefill_seconds(waiting_tokens)
        remaining = self.expected_output(stats.remaining_decode_tokens, stats.remaining_known_decode_tokens)
        queued = self.expected_output(stats.waiting_decode_tokens, stats.waiting_known_decode_tokens)
        work = _Work(remaining, queued, queued / stats.num_queue_reqs if stats.num_queue_reqs
                     else 2 * remaining / running if running else 0.0)
        # One request of the queue (its mean; this request's own when none waits): its prompt, the output
        # it may write and the output it is expected to write.
        if ahead:
            prompt_q, max_q, out_q = (waiting_tokens / ahead, stats.waiting_decode_tokens / ahead,
                                      work.waiting / ahead)
        else:
            prompt_q, max_q = prompt_tokens, new_tokens
            out_q = new_tokens if new_known else self.expected_output(new_tokens)
        # KV: the engine starts a request only when the free pool, less what it holds back for the running
        # requests' output (Retractor's new-token ratio, which starts high after an idle spell), holds its
        # prompt and what it would hold back for it; running, one holds on average its prompt, half its
        # expected output and what is held back for the rest. That ratio, not the share the requests use,
        # sets how many run at once (a pool of 4096 tokens: 14 of the requests above, not 29).
        ratio = self._engine_ratio(stats)
        used = max(stats.num_used_tokens, 0)
        start_need = prompt_q + ratio * max_q
        run_need = prompt_q + out_q / 2 + ratio * max(max_q - out_q / 2, 0.0)
        # Slots: this request is number ahead + 1 in line for a place in the batch; the places free now are
        # the batch's free slots, as far as the free pool holds their requests.
        if stats.max_running_reqs:
            free_slots = max(stats.max_running_reqs - running, 0)
            if start_need > 0 and stats.max_total_tokens:
                free_kv = stats.max_total_tokens - used - stats.reserved_decode_tokens
                free_slots = min(free_slots, int(max(free_kv, 0) // start_need))
        else:
            free_slots = ahead + 1
        batch = self._batch(stats, ahead, run_need)
        rate = self.steps.rate(batch) if batch else 0.0
        if not rate:  # no decode steps measured per batch size yet: the window's average
            rate, batch = self.decode_tok_s, 0.0
        slots_s = self._finish_time(running, work, ahead + 1 - free_slots, rate)
        # KV: what the queue and this prompt need beyond the free pool (evictable cache counts as free:
        # it is given back on demand), freed by finishing requests that each hold used / running.
        shortfall = waiting_tokens + prompt_tokens - (stats.max_total_tokens - used)
        kv_s = (self._finish_time(running, work, math.ceil(shortfall * running / used), rate)
                if shortfall > 0 and used else 0.0)
        pf_rate = waiting_tokens / prefill_s if prefill_s else self.prefill_tok_s
        return WaitEstimate(prefill_s + max(kv_s, slots_s), prefill_s, kv_s, slots_s, pf_rate, rate, batch,
                            output_share=self.output.share)

    @staticmethod
    def _engine_ratio(stats: SchedulerStats) -> float:
        """KV the engine holds back per token of max_new_tokens still allowed (1: it does not say)."""
        for reserved, allowed in ((stats.reserved_decode_tokens, stats.remaining_decode_tokens),
                                  (stats.waiting_reserved_decode_tokens, stats.waiting_decode_tokens)):
            if reserved > 0 and allowed > 0:
                return min(reserved / allowed, 1.0)
        return 1.0

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
    def _finish_time(running: int, work: _Work, k: int, rate: float) -> float:
        """How long until k more requests have finished decoding, at `rate` decode tokens per second."""
        if k <= 0 or not rate:
            return 0.0
        first = min(k, running)
        drain_s = work.remaining / rate
        return drain_s * first / max(running, 1) + (k - first) * work.per_queued / rate
