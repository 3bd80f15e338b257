"""PrefixIndex: the gateway's copy of what one replica's prefix cache holds, as page hashes
(runtime.mem_cache.block_hash), kept exact by the replica's own insert/evict events (CacheEvents), plus
the prompts routed to it that it has not reported yet.

The second part matters under concurrency: a burst of requests sharing a new system prompt arrives
before the first one's prefill has published anything, and without it they would scatter. A routed
prompt counts until its request leaves the replica; by then the replica's events (which a poll carries
ahead of the request's last delta) say what it really kept."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from runtime.messages import CacheEvents


class PrefixIndex:
    def __init__(self) -> None:
        self.seq = -1  # the replica's event log position seen so far; -1 asks for a snapshot
        self.held: set[int] = set()
        self._routed: Counter[int] = Counter()

    def apply(self, events: CacheEvents) -> None:
        if events.snapshot:
            self.held = set(events.stored)
        else:
            self.held.difference_update(events.removed)
            self.held.update(events.stored)
        self.seq = events.seq

    def reset(self) -> None:
        """The replica was relaunched: its cache starts empty and its log anew."""
        self.seq = -1
        self.held.clear()
        self._routed.clear()

    def route(self, hashes: Sequence[int]) -> None:
        self._routed.update(hashes)

    def unroute(self, hashes: Sequence[int]) -> None:
        self._routed.subtract(hashes)
        for h in hashes:
            if self._routed[h] <= 0:
                del self._routed[h]

    def size(self) -> int:
        """Pages held or about to be: how much this replica's cache carries."""
        return len(self.held) + len(self._routed)

    def matched_pages(self, hashes: Sequence[int]) -> int:
        """Leading pages of a prompt (its chained page hashes) this replica holds or is about to."""
        n = 0
        for h in hashes:
            if h not in self.held and h not in self._routed:
                break
            n += 1
        return n

    def cached_pages(self, hashes: Sequence[int]) -> int:
        """Leading pages the replica has reported holding (events only)."""
        n = 0
        for h in hashes:
            if h not in self.held:
                break
            n += 1
        return n
