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
                page: int = PAGE_TOKENS, salt: str | None = None) -> list[int]:
    """Hashes of pages start_page..end_page-1 of token_ids (full pages only; end_page None: all of them).
    The chain always starts at token 0, so the earlier pages are hashed too but not returned. A cache_salt
    seeds the chain (vLLM folds it into the first block's hash), so equal tokens under different salts, or
    salted and unsalted, name different prefixes, as the RadixCache keeps them in different trees."""
    full = len(token_ids) // page
    end = full if end_page is None else min(end_page, full)
    if end <= start_page:
        return []
    data = array("q", token_ids[:end * page]).tobytes()
    step = page * 8
    # Seeded, page 0's input is 8 bytes longer than an unsalted page 0's: never the same input.
    # surrogatepass: a Python caller's str may hold lone surrogates, which strict UTF-8 refuses.
    prev = b"" if salt is None else hashlib.blake2b(
        b"cache_salt\0" + salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    out: list[int] = []
    for k in range(end):
        prev = hashlib.blake2b(prev + data[k * step:(k + 1) * step], digest_size=8).digest()
        if k >= start_page:
            out.append(int.from_bytes(prev, "little", signed=True))
    return out
