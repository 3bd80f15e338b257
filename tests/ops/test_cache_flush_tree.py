"""The flush on the tree itself (KVCacheManager.flush over RadixCache): every unlocked node goes and its slots
are freed, the locked path of a running request stays whole, the accounting holds, the routing event log
hears of every namespace-0 page removed; and an adapter's namespace leaves no empty root behind once its last
node is evicted (LoRA ids are fresh per load), while a later insert under that id makes a new one."""

from __future__ import annotations

import torch

from runtime.managers.kv_cache_manager import KVCacheManager
from runtime.mem_cache.cache_event_log import CacheEventLog


def _insert(kv: KVCacheManager, ids: list[int], namespace: int = 0) -> None:
    slots = kv.allocator.alloc(len(ids))
    present = kv.cache.insert(ids, slots, namespace)
    kv.allocator.free(slots[:present])  # what the tree already held stays the caller's: freed, as a request does


def test_flush_keeps_what_is_locked_and_frees_the_rest():
    events = CacheEventLog(page=4)
    kv = KVCacheManager(256, 8, 128, enable_cache=True, cache_events=events)
    _insert(kv, list(range(40)))
    _insert(kv, list(range(20)) + list(range(100, 120)))  # shares 20 tokens with the first
    _insert(kv, list(range(200, 216)), namespace=3)  # an adapter's tree
    held = kv.cache.match_prefix(list(range(30)))  # a running request's prefix: 30 tokens, locked
    kv.cache.inc_lock_ref(held.last_node)
    total = kv.cache.total_size()
    assert total == 40 + 20 + 16 and events.held()
    freed = kv.flush()
    assert freed == total - 30 and kv.cache.evictable_size() == 0 and kv.cache.protected_size() == 30
    assert kv.allocator.available_size() == 256 - 30 and kv.evictions == 0  # a flush is not memory pressure
    assert sorted(kv.cache._roots) == [0]  # the adapter's root went with its last node
    # the routing log now holds exactly the locked path's full pages
    assert len(events.held()) == 30 // 4
    assert torch.equal(kv.cache.match_prefix(list(range(40))).kv_indices, held.kv_indices)
    kv.cache.dec_lock_ref(held.last_node)
    assert kv.flush() == 30 and kv.allocator.available_size() == 256 and not events.held()


def test_an_unloaded_adapters_namespace_leaves_no_root():
    kv = KVCacheManager(64, 4, 64, enable_cache=True)
    for lora_id in (1, 2, 3):  # three loads of an adapter: a fresh id (namespace) each
        _insert(kv, [7, 8, 9, lora_id], namespace=lora_id)
    assert sorted(kv.cache._roots) == [0, 1, 2, 3]
    everything = kv.alloc(64)  # memory pressure evicts every tree, its roots with them
    assert sorted(kv.cache._roots) == [0] and kv.cache.total_size() == 0
    kv.allocator.free(everything)
    _insert(kv, [7, 8, 9], namespace=2)  # an id used again: a new root
    assert kv.cache.match_prefix([7, 8, 9, 10], namespace=2).kv_indices.numel() == 3
    kv.cache.reset()
    assert sorted(kv.cache._roots) == [0]
