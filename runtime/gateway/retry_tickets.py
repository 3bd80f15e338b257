"""RetryTickets: the reservations behind Retry-After (a virtual queue for refused requests).

Under a flood the engine's queue is refilled by fresh arrivals the moment it drains, so "the time until
the queue has room" is not when a retry gets in: a retry at that time meets a queue full again and is
admitted with the chance capacity / arrival rate (1 in 10 at 10x). An honest Retry-After therefore has to
be a promise, not a forecast. Each refusal books a slot: the same request (same prompt tokens and
max_new_tokens) returning at or after its slot, within `grace_s` (long: the 429 may reach the client,
and the retry the server, seconds late when the HTTP layer itself is swamped), is admitted ahead of fresh arrivals
(AdmissionController lets it past the wait limit; the requests it admits count as waiting, so fresh ones
are refused until the queue drains). A client that waits exactly retry-after-ms, or the whole-second
Retry-After (at most 1 s later), sees a wait equal to what it was told.

Slots are booked in buckets of `bucket_s`. A bucket holds as many tickets as returning holders the engine
can start in it: start rate x bucket_s / show-up rate, where the show-up rate is the measured share of
tickets claimed by `resolve_s` past their slot (a flood's one-shot clients never return; booking every
ticket at full weight would push every promise minutes out for capacity nobody uses; a holder claiming
later, within grace, still counts as shown up). So booked returns stay, in expectation, within the
engine's start rate, and the queue's overshoot of --max-queue-wait-s by claimed tickets stays bounded
(the floor `min_show_up` caps the overbooking at 1/min_show_up; the prior, 1 in 10 until tickets
resolve, keeps the first second of a flood from booking far ahead).

A swamped HTTP layer delays both the 429 on its way out and the retry on its way in, so holders claim
late by that much (measured: 1.5-2 s on a 2-core host at 600 requests/s): `return_delay_s`, the moving
average of claimed tickets' lateness, is what the controller adds to the next promises, so the wait a
client sees (the Retry-After it slept plus the trip) stays within 2x of what it was told."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

SHOW_UP_HORIZON = 256  # resolved tickets (claimed or expired) the show-up rate averages over
RETURN_DELAY_HORIZON = 16  # claimed tickets the return delay averages over (it follows the load quickly)


@dataclass(frozen=True, slots=True)
class Claim:
    admit: bool  # True: a ticket was due; admit ahead of the wait limit
    retry_after_s: float = 0.0  # admit False: the holder came early, this is how long its ticket still is


class RetryTickets:
    def __init__(self, bucket_s: float = 0.5, grace_s: float = 30.0, early_s: float = 0.05,
                 resolve_s: float = 0.25, min_show_up: float = 0.02):
        self.bucket_s, self.grace_s, self.early_s, self.min_show_up = bucket_s, grace_s, early_s, min_show_up
        self.resolve_s = resolve_s
        self._by_key: dict[object, deque[int]] = {}  # request key → its ticket ids, earliest first
        self._slot: dict[int, tuple[object, float]] = {}  # ticket id → (key, slot time)
        self._expiry: list[tuple[float, int]] = []  # heap of (slot + grace, ticket id)
        self._due: list[tuple[float, int]] = []  # heap of (slot + resolve_s, ticket id): not yet resolved
        self._resolved: set[int] = set()  # live tickets already counted as no-shows
        self._booked: dict[int, int] = {}  # bucket index → tickets booked in it
        self._next_id = 0
        # Exponentially decayed counts of resolved tickets; the prior: 1 in 10 come back (weight 2).
        self.claimed, self.resolved = 0.2, 2.0
        self.return_delay_s, self.return_samples = 0.0, 0

    @property
    def show_up(self) -> float:
        return min(max(self.claimed / self.resolved, self.min_show_up), 1.0)

    def __len__(self) -> int:
        return len(self._slot)

    def _resolve(self, claimed: bool) -> None:
        decay = 1.0 - 1.0 / SHOW_UP_HORIZON
        self.claimed = self.claimed * decay + claimed
        self.resolved = self.resolved * decay + 1.0

    def _claimed_late(self) -> None:
        """A holder counted as a no-show came within grace after all."""
        self.claimed += 1.0

    def _drop(self, tid: int) -> None:
        key, slot = self._slot.pop(tid)
        ids = self._by_key[key]
        ids.remove(tid)
        if not ids:
            del self._by_key[key]
        b = math.floor(slot / self.bucket_s)
        if self._booked.get(b, 0) > 1:
            self._booked[b] -= 1
        else:
            self._booked.pop(b, None)

    def _returned(self, late_s: float) -> None:
        self.return_samples += 1
        a = 1.0 / min(self.return_samples, RETURN_DELAY_HORIZON)
        self.return_delay_s += a * (late_s - self.return_delay_s)

    def expire(self, now: float) -> None:
        """Tickets not claimed by resolve_s past their slot count as no-shows; past grace_s they lapse."""
        while self._due and self._due[0][0] < now:
            _, tid = heapq.heappop(self._due)
            if tid in self._slot:
                self._resolved.add(tid)
                self._resolve(False)
        while self._expiry and self._expiry[0][0] < now:
            _, tid = heapq.heappop(self._expiry)
            if tid in self._slot:
                self._drop(tid)
                self._resolved.discard(tid)

    def claim(self, key: object, now: float, early_ok: bool = False) -> Claim | None:
        """None: the key holds no live ticket (a fresh request). A ticket claimed is used up; one not yet
        due is kept, unless early_ok (the queue has room anyway: the holder needs no reservation)."""
        self.expire(now)
        ids = self._by_key.get(key)
        if not ids:
            return None
        tid = min(ids, key=lambda i: self._slot[i][1])  # a later booking may have found an earlier bucket
        slot = self._slot[tid][1]
        if now < slot - self.early_s and not early_ok:
            return Claim(False, slot - now)
        self._drop(tid)
        if now >= slot - self.early_s:  # a holder let in early says nothing about the trip's delay
            self._returned(max(now - slot, 0.0))
        if tid in self._resolved:
            self._resolved.discard(tid)
            self._claimed_late()
        else:
            self._resolve(True)
        return Claim(True)

    def book(self, key: object, now: float, earliest_s: float, start_rate: float) -> float:
        """Books the first slot at least earliest_s from now in a bucket with room; returns its delay.
        start_rate: requests per second the engine starts (0: unknown, no pacing)."""
        self.expire(now)
        t = now + earliest_s
        b = math.floor(t / self.bucket_s)
        if start_rate > 0:
            room = max(1, math.floor(start_rate * self.bucket_s / self.show_up))
            while self._booked.get(b, 0) >= room:
                b += 1
            t = max(t, b * self.bucket_s)
        self._booked[b] = self._booked.get(b, 0) + 1
        tid, self._next_id = self._next_id, self._next_id + 1
        self._slot[tid] = (key, t)
        self._by_key.setdefault(key, deque()).append(tid)
        heapq.heappush(self._expiry, (t + self.grace_s, tid))
        heapq.heappush(self._due, (t + self.resolve_s, tid))
        return t - now
