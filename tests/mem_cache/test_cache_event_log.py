"""CacheEventLog: the RadixCache's inserts and evictions, as page-hash events, keep a reader's copy
exactly equal to the pages the tree holds — checked against the tree itself after random inserts,
lock/unlock and evictions, both for a reader that follows every step and one that only catches up
at the end (or falls behind the bounded log and gets a snapshot)."""

from __future__ import annotations

import random

import torch

from runtime.mem_cache.allocator import KVAllocator
from runtime.mem_cache.block_hash import page_hashes
from runtime.mem_cache.cache_event_log import CacheEventLog
from runtime.mem_cache.radix_cache import RadixCache
from runtime.messages import CacheEvents

PAGE = 4


def tree_pages(cache: RadixCache) -> set[int]:
    """Every full page of every root-to-node path: what the tree holds, by definition."""
    out: set[int] = set()
    stack = [(c, []) for c in cache.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        path = prefix + list(node.key)
        out.update(page_hashes(path, page=PAGE))
        stack.extend((c, path) for c in node.children.values())
    return out


class Reader:
    def __init__(self) -> None:
        self.seq, self.held, self.snapshots = -1, set(), 0

    def apply(self, ev: CacheEvents) -> None:
        if ev.snapshot:
            self.held, self.snapshots = set(ev.stored), self.snapshots + 1
        else:
            assert not set(ev.stored) & set(ev.removed)
            self.held.difference_update(ev.removed)
            self.held.update(ev.stored)
        self.seq = ev.seq


def test_page_hashes_chain_and_slice():
    ids = list(range(50))
    full = page_hashes(ids, page=PAGE)
    assert len(full) == 12  # 50 // 4 full pages; the partial one is never named
    assert page_hashes(ids, 3, 7, page=PAGE) == full[3:7]
    assert page_hashes(ids[:20], page=PAGE) == full[:5]  # a prefix's pages are the prefix of the pages
    other = list(ids)
    other[1] = 999  # one token early on changes every later page (the hash names the whole prefix)
    assert not set(page_hashes(other, page=PAGE)) & set(full)


def test_events_mirror_the_tree_through_random_churn():
    rng = random.Random(0)
    log = CacheEventLog(page=PAGE, max_events=64)
    cache = RadixCache(KVAllocator(4000), events=log)
    follower, late = Reader(), Reader()
    bases = [[rng.randrange(50) for _ in range(rng.randint(4, 30))] for _ in range(6)]
    locked = []
    for step in range(400):
        op = rng.random()
        if op < 0.55:
            seq = rng.choice(bases)[: rng.randint(1, 30)] + [rng.randrange(50) for _ in range(rng.randint(0, 12))]
            m = cache.match_prefix(seq)
            n = m.kv_indices.numel()
            slots = cache.allocator.alloc(len(seq) - n)
            assert slots is not None
            present = cache.insert(seq, torch.cat([m.kv_indices, slots]))
            if present > n:
                cache.allocator.free(slots[: present - n])
            if rng.random() < 0.3:
                node = cache.match_prefix(seq).last_node
                cache.inc_lock_ref(node)
                locked.append(node)
        elif op < 0.85:
            cache.evict(rng.randint(1, 40))
        elif locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        follower.apply(log.since(follower.seq))
        assert follower.held == tree_pages(cache) == log.held(), step
    late.apply(log.since(late.seq))
    assert late.held == tree_pages(cache) and late.snapshots == 1
    for node in locked:
        cache.dec_lock_ref(node)
    cache.reset()
    follower.apply(log.since(follower.seq))
    assert follower.held == set() and follower.snapshots == 1  # the only snapshot was its first read


def test_reader_behind_the_bounded_log_gets_a_snapshot():
    log = CacheEventLog(page=PAGE, max_events=4)
    cache = RadixCache(KVAllocator(1000), events=log)
    reader = Reader()
    reader.apply(log.since(-1))
    for i in range(10):
        ids = [i] * 8
        cache.insert(ids, cache.allocator.alloc(8))
    ev = log.since(reader.seq)
    assert ev.snapshot and set(ev.stored) == tree_pages(cache)
    reader.apply(ev)
    cache.insert([42] * 9, cache.allocator.alloc(9))
    ev = log.since(reader.seq)
    assert not ev.snapshot and set(ev.stored) == set(page_hashes([42] * 9, page=PAGE))
