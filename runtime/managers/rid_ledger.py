"""RidLedger: the scheduler's short memory of request ids it no longer (or does not yet) hold.

An abort can overtake its own request (both travel through the inbox from different tasks), so an abort
for an unknown rid is remembered and ends the request the moment it arrives; an abort for a rid that
ended lately is dropped, so a later request reusing the rid does not inherit it. Both memories are
bounded (oldest forgotten first)."""

from __future__ import annotations


class RidLedger:
    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._early_aborts: dict[str, None] = {}
        self._finished: dict[str, None] = {}

    def abort_unknown(self, rid: str) -> None:
        """An abort for a rid the scheduler does not hold: remembered unless that rid just ended."""
        if rid in self._finished:
            return
        self._early_aborts[rid] = None
        self._trim(self._early_aborts)

    def arrived(self, rid: str) -> bool:
        """A request with this rid arrived: True when an abort for it came first (it ends at once)."""
        self._finished.pop(rid, None)
        return self._early_aborts.pop(rid, False) is None

    def refused(self, rid: str) -> None:
        """A request with this rid was refused before it was held: an early abort for it is spent."""
        self._early_aborts.pop(rid, None)

    def finished(self, rid: str) -> None:
        self._finished[rid] = None
        self._trim(self._finished)

    def _trim(self, d: dict[str, None]) -> None:
        while len(d) > self.capacity:
            d.pop(next(iter(d)))
