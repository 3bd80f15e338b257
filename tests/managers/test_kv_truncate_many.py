"""KVCacheManager.truncate_many: a verify step's rejected drafts of every request freed with one
allocator call, from the host-side tail or from the materialized slots alike."""

import pytest
import torch

from runtime.managers.kv_cache_manager import KVCacheManager
from runtime.managers.req import Req
from runtime.sampling.params import SamplingParams


def _req(rid: str, kv: KVCacheManager, base: int, tail: int) -> Req:
    r = Req(rid, [1, 2, 3], SamplingParams(), 0, frozenset())
    r.kv_indices = kv.allocator.alloc(base)
    for s in kv.allocator.alloc(tail).tolist():
        r.append_kv_slot(s)
    return r


def test_truncate_many_frees_tail_and_base_slots_once_each() -> None:
    kv = KVCacheManager(64, 4, 32, enable_cache=False)
    a, b, c = _req("a", kv, 6, 5), _req("b", kv, 6, 5), _req("c", kv, 6, 5)
    a_kv, b_kv = a.kv_indices.clone(), b.kv_indices.clone()  # materializes a's and b's tails
    c_tail = list(c._kv_tail)
    free_before = kv.allocator.available_size()
    kv.truncate_many([(a, 8), (b, 4), (c, 9)])  # a and c: within the tail; b: into the base
    assert torch.equal(a.kv_indices, a_kv[:8]) and torch.equal(b.kv_indices, b_kv[:4])
    assert c.kv_len == 9 and c.kv_indices[6:].tolist() == c_tail[:3]
    assert kv.allocator.available_size() == free_before + 3 + 7 + 2
    c2 = _req("c2", kv, 0, 0)
    with pytest.raises(ValueError, match="cached prefix"):
        c2.cached_len = 2
        kv.truncate_many([(c2, 1)])
