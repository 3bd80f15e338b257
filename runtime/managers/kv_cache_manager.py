"""KVCacheManager: the scheduler's one view of KV memory — the slot allocator, the request→token table
and the prefix cache — and the rules that move slots between requests and the cache."""

from __future__ import annotations

import torch

from runtime.lora.lora_slots import LoraSlots
from runtime.managers.req import Req
from runtime.mem_cache.allocator import KVAllocator
from runtime.mem_cache.cache_event_log import CacheEventLog
from runtime.mem_cache.radix_cache import RadixCache
from runtime.mem_cache.req_to_token import ReqToTokenPool


class KVCacheManager:
    def __init__(self, max_total_tokens: int, max_reqs: int, context_len: int, enable_cache: bool,
                 cache_events: CacheEventLog | None = None, loras: LoraSlots | None = None):
        self.allocator = KVAllocator(max_total_tokens)
        self.req_slots = ReqToTokenPool(max_reqs, 1, "cpu")  # only hands out rows; workers hold the table
        self.cache = RadixCache(self.allocator, disable=not enable_cache, events=cache_events)
        self.enabled = enable_cache
        self.evictions = 0  # tokens evicted from the cache, ever
        # --enable-lora: adapter slots, taken with a request's admission and given back with its KV
        self.loras = loras

    @property
    def size(self) -> int:
        return self.allocator.size

    def available(self) -> int:
        """Slots a new allocation can get: free now plus what the cache could give back."""
        return self.allocator.available_size() + self.cache.evictable_size()

    def prefix_len(self, req: Req) -> int:
        """Cached prefix length without locking (for ordering the waiting queue)."""
        if not self._can_match(req):
            return 0
        return int(self.cache.match_prefix(req.all_ids[:-1], req.cache_namespace).kv_indices.numel())

    def _can_match(self, req: Req) -> bool:
        return self.enabled and not req.return_input_logprob

    def admit(self, req: Req) -> bool:
        """Gives a waiting request a table row and its cached prefix (locked). False if no row is free."""
        rows = self.req_slots.alloc(1)
        if rows is None:
            return False
        req.req_pool_idx = rows[0]
        if self._can_match(req):
            m = self.cache.match_prefix(req.all_ids[:-1], req.cache_namespace)
            req.kv_indices, req.cached_len, req.last_node = m.kv_indices.clone(), m.kv_indices.numel(), m.last_node
            self.cache.inc_lock_ref(m.last_node)
        req.pending_prefix_write = req.cached_len
        return True

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots, evicting from the cache when the free list is short; None if even that is not enough."""
        short = n - self.allocator.available_size()
        if short > 0:
            self.evictions += self.cache.evict(short)
        return self.allocator.alloc(n)

    def flush(self) -> int:
        """Drops every cached prefix no live request holds (their slots go back to the free list); how many
        tokens. Locked nodes, and so every running request's prefix, stay. Not counted as evictions: those
        are the cache giving way to memory pressure."""
        return self.cache.evict(self.cache.evictable_size())

    def release_finished(self, req: Req) -> None:
        """A finished (or aborted) request: its KV goes to the prefix cache, or back to the free list."""
        if req.req_pool_idx is None:
            return
        kv_len = req.kv_len
        if self.enabled and not req.return_input_logprob and kv_len:
            present = self.cache.insert(req.all_ids[:kv_len], req.kv_indices, req.cache_namespace)
            if present > req.cached_len:
                self.allocator.free(req.kv_indices[req.cached_len:present])
        else:
            self.allocator.free(req.kv_indices[req.cached_len:])
        self._drop(req)

    def cache_unfinished(self, req: Req, computed: int) -> None:
        """After a prefill chunk: share the `computed` tokens whose KV now exists, and hold the cache's
        copy of them. Slots past `computed` (a next chunk already scheduled) are left alone."""
        if not self.enabled or req.return_input_logprob or not computed:
            return
        ids = req.all_ids[:computed]
        kv = req.kv_indices
        present = self.cache.insert(ids, kv[:computed], req.cache_namespace)
        if present > req.cached_len:
            self.allocator.free(kv[req.cached_len:present])
        m = self.cache.match_prefix(ids, req.cache_namespace)
        self.cache.inc_lock_ref(m.last_node)
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
        n = m.kv_indices.numel()
        req.kv_indices = torch.cat([m.kv_indices, kv[n:]])
        req.cached_len, req.last_node = n, m.last_node
        req.pending_prefix_write = max(req.pending_prefix_write, present)

    def release_retracted(self, req: Req) -> None:
        """Frees what only this request holds; the cached prefix stays in the cache for its return."""
        if req.req_pool_idx is None:
            return
        self.allocator.free(req.kv_indices[req.cached_len:])
        self._drop(req)

    def truncate(self, req: Req, keep: int) -> None:
        """Frees the request's own slots past its first `keep` tokens (speculative drafts it rejected)."""
        if keep < req.cached_len:
            raise ValueError(f"cannot truncate below the cached prefix ({keep} < {req.cached_len})")
        kv = req.kv_indices
        self.allocator.free(kv[keep:])
        req.kv_indices = kv[:keep]

    def truncate_many(self, cuts: list[tuple[Req, int]]) -> None:
        """truncate() for several requests with one allocator call (a verify step frees a few slots of
        each request of the batch; one free per request cost more than the rest of the bookkeeping)."""
        ints: list[int] = []
        tensors: list[torch.Tensor] = []
        for req, keep in cuts:
            if keep < req.cached_len:
                raise ValueError(f"cannot truncate below the cached prefix ({keep} < {req.cached_len})")
            dropped = req.pop_kv_after(keep)
            if isinstance(dropped, list):
                ints += dropped
            elif dropped.numel():
                tensors.append(dropped)
        if ints:
            tensors.append(torch.tensor(ints, dtype=torch.int64))
        if tensors:
            self.allocator.free(torch.cat(tensors) if len(tensors) > 1 else tensors[0])

    def _drop(self, req: Req) -> None:
        if self.loras is not None:
            self.loras.release(req)
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
        self.req_slots.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node = None, None
        req.kv_indices, req.cached_len = torch.empty(0, dtype=torch.int64), 0

    def held_by(self, reqs: list[Req]) -> int:
        return sum(r.kv_len - r.cached_len for r in reqs)

    def check_invariant(self, live: list[Req]) -> None:
        """free + cached + held by live requests == total slots. Raises AssertionError on a leak."""
        free, cached, held = self.allocator.available_size(), self.cache.total_size(), self.held_by(live)
        if free + cached + held != self.size:
            raise AssertionError(f"KV accounting broken: free {free} + cached {cached} + held {held} != {self.size}")
