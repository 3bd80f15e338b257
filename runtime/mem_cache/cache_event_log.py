"""CacheEventLog: the RadixCache's inserts and evictions as a log of page-hash events (block_hash), so
a gateway can keep an exact copy of which prefixes a replica holds and route on it.

The tree holds the prefix of length n of a path iff it holds that path's first n tokens; page k is
cached iff the prefix ending at page k is. So an insert that grows a path from `present` to `n` tokens
stores the pages ending in (present, n], and evicting a leaf that spanned [start, end) of its path
removes the pages ending in (start, end]. Every page is stored once and removed once, so the current
set needs no counts.

Readers (an actor's event loop) and the writer (the scheduler thread) meet under one lock. A reader
asks for everything since the sequence number it last saw; one too far behind (the log is bounded) or
new gets a snapshot of the whole set instead."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from runtime.mem_cache.block_hash import PAGE_TOKENS, page_hashes
from runtime.messages import CacheEvents


class CacheEventLog:
    def __init__(self, page: int = PAGE_TOKENS, max_events: int = 4096):
        self.page = page
        self._lock = threading.Lock()
        self._seq = 0
        self._events: deque[tuple[int, bool, list[int]]] = deque(maxlen=max_events)  # (seq, stored?, hashes)
        self._held: set[int] = set()

    # ---- the scheduler thread (RadixCache) --------------------------------------------------------
    def stored(self, path: Sequence[int], present: int, salt: str | None = None) -> None:
        """The tree now holds path whole; it held its first `present` tokens before. salt: the tree's
        cache_salt (its pages' hashes are seeded with it, as a salted prompt's are where it is routed)."""
        hashes = page_hashes(path, _first_page_ending_after(present, self.page), page=self.page, salt=salt)
        if hashes:
            self._append(True, hashes)

    def removed(self, path: Sequence[int], start: int, salt: str | None = None) -> None:
        """The tree dropped path[start:] (an evicted leaf); path[:start] stays."""
        hashes = page_hashes(path, _first_page_ending_after(start, self.page), page=self.page, salt=salt)
        if hashes:
            self._append(False, hashes)

    def cleared(self) -> None:
        with self._lock:
            if self._held:
                self._seq += 1
                self._events.append((self._seq, False, list(self._held)))
                self._held.clear()

    def _append(self, stored: bool, hashes: list[int]) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, stored, hashes))
            if stored:
                self._held.update(hashes)
            else:
                self._held.difference_update(hashes)

    # ---- readers ------------------------------------------------------------------------------------
    def since(self, seq: int) -> CacheEvents:
        """Net changes after `seq` (a hash stored then removed again shows only as removed), or a snapshot
        when seq is older than the log reaches (or -1: a new reader)."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self._seq + 1
            if seq < 0 or seq > self._seq or seq < oldest - 1:
                return CacheEvents(seq=self._seq, stored=list(self._held), snapshot=True)
            last: dict[int, bool] = {}
            for s, stored, hashes in reversed(self._events):
                if s <= seq:
                    break
                for h in hashes:
                    last.setdefault(h, stored)  # walking backwards: the first seen is the latest
            return CacheEvents(seq=self._seq, stored=[h for h, st in last.items() if st],
                               removed=[h for h, st in last.items() if not st])

    def held(self) -> set[int]:
        with self._lock:
            return set(self._held)


def _first_page_ending_after(n: int, page: int) -> int:
    """Index of the first page whose end lies after token n (pages ending at or before n are unchanged)."""
    return n // page
