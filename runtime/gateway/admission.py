"""AdmissionController: refuses a request up front (429 with Retry-After) when the engine could not
start it soon, so a flood never builds a queue that accepted requests would time out in, and every
request it lets in completes.

It reads the engine's real state (EngineClient.stats(): the summed replicas on Ray, the scheduler
in-process), refreshed in the background at most every `refresh_s` (a request never waits for it), for
what runs (requests, KV held, decode left) and the recent rates; the queue itself it knows better than
any snapshot: every request it admitted waits until its first delta comes back (or it ends), so those
are counted the moment they are admitted — a burst cannot slip in between two snapshots. A snapshot
older than `stale_s` is not decided on: nothing asked for one while no request came, so it describes
the load before an idle spell (an idle server once refused a 2-prompt request as "about 74.7 s" from the
queue of a burst long gone); the first request after the spell waits for a fresh one (at most
`stale_wait_s`; an idle engine answers at once). A request is refused when
  - more than --max-waiting-requests would wait ahead of it, or
  - its estimated wait (WaitEstimator) exceeds --max-queue-wait-s.

Retry-After is a reservation, not a forecast (RetryTickets says why a forecast cannot be honest while
fresh arrivals refill the queue): the refused request books a slot no earlier than the estimate says the
queue will have drained to the admission level: the share of the queue that must start first (for the
wait limit, the estimated wait past the limit over the estimated wait; for the count, the excess) at the
rate the engine starts requests (measured from the first deltas over `rate_window_s`; the model's own
seconds until there are a few), at least `min_retry_s` (1 s: sooner only adds to the flood); bookings
are paced by that start rate too.
The same request coming back at its slot is admitted ahead of fresh arrivals, past the wait limit (not
past --max-waiting-requests, the hard bound); one coming early is told how long its ticket still is.
HTTP wants whole seconds; `retry-after-ms` (which OpenAI's clients read first) gives it to the
millisecond, and a client waiting the rounded-up seconds is still within the ticket's grace.
A promise also covers the trip: when the HTTP layer itself is swamped, the 429 reaches the client and
the retry the server each late by about the event loop's lag; that delay (measured from returning
tickets, RetryTickets.return_delay_s, or twice the loop's recent lag, LoopLag, whichever is larger) is
added to the slot, so the wait a client sees stays within 2x of the Retry-After it was given."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass

import msgspec

from runtime.engine_client import EngineClient
from runtime.gateway.loop_lag import LoopLag
from runtime.gateway.retry_tickets import RetryTickets
from runtime.gateway.wait_estimator import WaitEstimate, WaitEstimator
from runtime.messages import GenerateRequest, SchedulerStats

CORRECTION_SAMPLES = 64  # the moving averages' horizon, in admitted requests
MIN_SAMPLE_WAIT_S = 0.05  # shorter estimates say little about the model's error (timer noise dominates)


def length_known(req: GenerateRequest) -> bool:
    """Only max_new_tokens can end it (Req.length_known as far as the gateway sees: a model without an
    EOS token also makes it so, and is found out once the engine counts the request)."""
    p = req.sampling_params
    return p.ignore_eos and not (p.stop or p.stop_token_ids or p.grammar)


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str  # "queue_wait" | "waiting_requests"
    retry_after_s: float
    message: str

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s))),
                "retry-after-ms": str(max(1, round(self.retry_after_s * 1000)))}


class AdmissionController:
    def __init__(self, max_queue_wait_s: float, max_waiting_requests: int, refresh_s: float = 0.2,
                 min_retry_s: float = 1.0, rate_window_s: float = 5.0, stale_s: float = 1.0,
                 stale_wait_s: float = 1.0):
        self.max_queue_wait_s, self.max_waiting_requests = max_queue_wait_s, max_waiting_requests
        self.refresh_s, self.min_retry_s, self.rate_window_s = refresh_s, min_retry_s, rate_window_s
        self.stale_s, self.stale_wait_s = stale_s, stale_wait_s
        self.estimator = WaitEstimator()
        self.tickets = RetryTickets()
        self.loop_lag = LoopLag()
        self._starts: deque[float] = deque()  # when admitted requests started, over rate_window_s
        self.stats: SchedulerStats | None = None
        self.stats_t = -math.inf  # when the snapshot's stats() call began
        self.last_estimate: WaitEstimate | None = None
        # rid → (prompt tokens, max new tokens, admitted at, the model's wait estimate, max new tokens if only
        # the length can end it else 0): admitted, not started
        self._waiting: dict[str, tuple[int, int, float, float, int]] = {}
        # What the model cannot see (other tenants of the machine, the gateway's own load, queue order)
        # shows as a steady gap between the waits it estimated and those requests then saw: estimates are
        # scaled by the ratio of their moving averages (after a few samples; clipped to [0.5, 10]).
        self.correction = 1.0
        self._seen_wait = self._est_wait = 0.0
        self._samples = 0
        self._refreshing: asyncio.Future | None = None

    # ---- the engine's state ---------------------------------------------------------------------
    async def refresh(self, client: EngineClient) -> None:
        """One stats() call at a time; concurrent callers share it."""
        await asyncio.shield(self.refresh_soon(client))

    def refresh_soon(self, client: EngineClient) -> asyncio.Future:
        """Starts a stats() call in the background unless one is under way; returns it."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh(client))
        return self._refreshing

    async def _refresh(self, client: EngineClient) -> None:
        started = time.monotonic()
        try:
            stats = await client.stats()
        except Exception:  # no fresh numbers: decide on the last ones
            return
        self.observe(started, stats)

    def observe(self, started: float, stats: SchedulerStats) -> None:
        self.stats, self.stats_t = stats, started
        self.estimator.observe(started, stats)

    def started(self, rid: str, now: float | None = None) -> None:
        """The request's first delta came back (or it ended): it no longer waits. Idempotent."""
        entry = self._waiting.pop(rid, None)
        if entry is None:
            return
        now = time.monotonic() if now is None else now
        self._starts.append(now)
        while self._starts and now - self._starts[0] > self.rate_window_s:
            self._starts.popleft()
        if entry[3] < MIN_SAMPLE_WAIT_S:
            return
        seen = now - entry[2]
        a = 1.0 / min(self._samples + 1, CORRECTION_SAMPLES)
        self._seen_wait += a * (seen - self._seen_wait)
        self._est_wait += a * (entry[3] - self._est_wait)
        self._samples += 1
        if self._samples >= 5:
            self.correction = min(max(self._seen_wait / self._est_wait, 0.5), 10.0)

    def start_rate(self, ahead: int, est: WaitEstimate) -> float:
        """Requests per second the engine starts: measured from the last rate_window_s of first deltas
        (once there are a few, over at least a second), else what the estimate implies for the queue."""
        if len(self._starts) >= 5 and self._starts[-1] - self._starts[0] >= 1.0:
            return (len(self._starts) - 1) / (self._starts[-1] - self._starts[0])
        return ahead / est.wait_s if ahead and est.wait_s > 0 else 0.0

    @staticmethod
    def ticket_key(reqs: list[GenerateRequest]) -> int:
        """What makes a retry the same request (rids are fresh on every HTTP call); a hash, so thousands
        of live tickets do not hold their prompts."""
        return hash(tuple((tuple(r.input_ids), r.sampling_params.max_new_tokens) for r in reqs))

    def scaled(self, est: WaitEstimate, trip_s: float = 0.0) -> WaitEstimate:
        return dataclasses.replace(est, wait_s=est.wait_s * self.correction, correction=self.correction,
                                   trip_s=trip_s)

    def trip_s(self, now: float) -> float:
        """How late a retry told to come back now+x arrives (the 429 out plus the retry in)."""
        return max(self.tickets.return_delay_s, 2 * self.loop_lag.recent_s(now))

    # ---- decisions --------------------------------------------------------------------------------
    async def check(self, client: EngineClient, reqs: list[GenerateRequest]) -> Refusal | None:
        """None: admitted (and counted as waiting until `started`); else why not. Decides on the last
        snapshot and refreshes a stale one in the background: on Ray stats() is an actor call that waits
        for the step in progress, and a request must not wait for it (its first token would). Only the
        very first request waits, for the first snapshot (a flood at start-up is still judged), and the
        first after an idle spell, for one that is not from before it."""
        self.loop_lag.ensure_started()
        age = time.monotonic() - self.stats_t
        if self.stats is None:
            await self.refresh(client)
        elif age > self.stale_s:
            try:
                await asyncio.wait_for(self.refresh(client), self.stale_wait_s)
            except asyncio.TimeoutError:  # a slow engine: the old numbers beat none (the refresh goes on)
                pass
        elif age > self.refresh_s:
            self.refresh_soon(client)
        return self.decide(reqs)

    def decide(self, reqs: list[GenerateRequest], now: float | None = None) -> Refusal | None:
        stats = self.stats
        if stats is None:
            return None
        now = time.monotonic() if now is None else now
        key = self.ticket_key(reqs)
        claim = self.tickets.claim(key, now)
        # The engine's queue as this gateway knows it (exact and current) or as the snapshot says, if more
        # (another client may share the engine).
        ahead = max(stats.num_queue_reqs, len(self._waiting))
        view = msgspec.structs.replace(
            stats, num_queue_reqs=ahead,
            waiting_tokens=max(stats.waiting_tokens, sum(w[0] for w in self._waiting.values())))
        own_decode = sum(w[1] for w in self._waiting.values())
        if own_decode > stats.waiting_decode_tokens:
            view.waiting_decode_tokens = own_decode
            view.waiting_known_decode_tokens = sum(w[4] for w in self._waiting.values())
        trip = self.trip_s(now)
        est = self.scaled(self.estimator.estimate(view, sum(len(r.input_ids) for r in reqs),
                                                  new_tokens=sum(r.sampling_params.max_new_tokens for r in reqs),
                                                  new_known=all(length_known(r) for r in reqs)),
                          trip)
        self.last_estimate = est
        early = claim is not None and not claim.admit  # came before its slot: the ticket still holds
        if early and (ahead + len(reqs) > self.max_waiting_requests or est.wait_s > self.max_queue_wait_s):
            return Refusal("queue_wait", claim.retry_after_s,
                           f"this request holds a reservation in {claim.retry_after_s:.1f} s; retry then")
        if ahead + len(reqs) > self.max_waiting_requests:
            excess = ahead + len(reqs) - self.max_waiting_requests
            rate = self.start_rate(ahead, est)
            drain_s = excess / rate if rate else 0.0
            retry = self.tickets.book(key, now, max(drain_s, self.min_retry_s) + trip, rate)
            return Refusal("waiting_requests", retry,
                           f"the server's queue is full ({ahead} requests waiting, at most "
                           f"{self.max_waiting_requests}); retry after {retry:.1f} s")
        if early:
            self.tickets.claim(key, now, early_ok=True)  # room anyway: the reservation is not needed
        elif est.wait_s > self.max_queue_wait_s and claim is None:
            # The model says which share of the queue must start before this request fits the limit;
            # the measured start rate says how long that takes (the model's seconds drift under a flood).
            rate = self.start_rate(ahead, est)
            excess = (est.wait_s - self.max_queue_wait_s) / est.wait_s
            drain_s = excess * ahead / rate if rate and ahead else est.wait_s - self.max_queue_wait_s
            retry = self.tickets.book(key, now, max(drain_s, self.min_retry_s) + trip, rate)
            return Refusal("queue_wait", retry,
                           f"the server is overloaded: this request would wait about {est.wait_s:.1f} s in the "
                           f"queue (at most {self.max_queue_wait_s:g} s); retry after {retry:.1f} s")
        for r in reqs:
            max_new = r.sampling_params.max_new_tokens
            self._waiting[r.rid] = (len(r.input_ids), max_new, now, est.wait_s / est.correction,
                                    max_new if length_known(r) else 0)
        return None
