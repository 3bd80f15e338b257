"""RidLedger: the scheduler's short memory of request ids it no longer (or does not yet) hold.

An abort can overtake its own request (both travel through the inbox from different tasks), so an abort
for an unknown rid is remembered and ends the request the moment it arrives; an abort for a rid that
ended lately is dropped, so a later request reusing the rid does not inherit it. Both memories are
bounded (oldest forgotten first), and an early abort is kept EARLY_ABORT_TTL_S only: an abort overtakes its
request by at most what the request waits for before the scheduler (a grammar's queue and compile, the gateway's
tokenizer worker: seconds, tens with a long --grammar-compile-timeout-s), while a stray one (a mistyped
/abort_request id) would otherwise end whichever later request happened to take that X-Request-Id."""

from __future__ import annotations

import time
from collections.abc import Callable

EARLY_ABORT_TTL_S = 300.0  # past any wait before the scheduler: a grammar queue + compile, the tokenizer worker


class RidLedger:
    def __init__(self, capacity: int = 4096, clock: Callable[[], float] = time.monotonic):
        self.capacity, self._clock = capacity, clock
        self._early_aborts: dict[str, float] = {}  # rid → when its abort came
        self._finished: dict[str, None] = {}

    def abort_unknown(self, rid: str) -> None:
        """An abort for a rid the scheduler does not hold: remembered unless that rid just ended."""
        if rid in self._finished:
            return
        self._early_aborts.pop(rid, None)  # re-inserted: its order (oldest first) is its latest abort's
        self._early_aborts[rid] = self._clock()
        self._trim(self._early_aborts)

    def arrived(self, rid: str) -> bool:
        """A request with this rid arrived: True when an abort for it came first (it ends at once)."""
        self._finished.pop(rid, None)
        at = self._early_aborts.pop(rid, None)
        return at is not None and self._clock() - at <= EARLY_ABORT_TTL_S

    def refused(self, rid: str) -> None:
        """A request with this rid was refused before it was held: an early abort for it is spent."""
        self._early_aborts.pop(rid, None)

    def finished(self, rid: str) -> None:
        self._finished[rid] = None
        self._trim(self._finished)

    def _trim(self, d: dict[str, None] | dict[str, float]) -> None:
        while len(d) > self.capacity:
            d.pop(next(iter(d)))
