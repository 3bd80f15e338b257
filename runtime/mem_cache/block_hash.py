"""Chained hashes of fixed-size token pages: the names a replica publishes for what its prefix cache
holds, and the gateway computes for a prompt to find where its longest prefix is cached.

Page k's hash covers every token before the end of page k (it folds in page k-1's hash), so one hash
names one whole prefix: the sets of two replicas can be compared page by page with no tree. Only full
pages count: a prefix is known cached to page granularity (PAGE_TOKENS), which is plenty for routing."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

PAGE_TOKENS = 16


def page_hashes(token_ids: Sequence[int], start_page: int = 0, end_page: int | None = None,
                page: int = PAGE_TOKENS) -> list[int]:
    """Hashes of pages start_page..end_page-1 of token_ids (full pages only; end_page None: all of them).
    The chain always starts at token 0, so the earlier pages are hashed too but not returned."""
    full = len(token_ids) // page
    end = full if end_page is None else min(end_page, full)
    if end <= start_page:
        return []
    data = array("q", token_ids[:end * page]).tobytes()
    step = page * 8
    prev = b""
    out: list[int] = []
    for k in range(end):
        prev = hashlib.blake2b(prev + data[k * step:(k + 1) * step], digest_size=8).digest()
        if k >= start_page:
            out.append(int.from_bytes(prev, "little", signed=True))
    return out
