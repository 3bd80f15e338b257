"""cache_salt (vLLM's, SGLang's): prefix-cache KV is shared only between requests of equal salt (None with
None). The RadixCache keeps each salt in a tree of its own under one LRU, reports salted trees to the routing
log under salted page hashes, and the engine's cached_tokens and outputs (against HF greedy) show it."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from tiny_models import hf_greedy_ids

from runtime import Engine
from runtime.errors import InvalidRequestError
from runtime.managers.request_validation import RequestLimits, validate_request
from runtime.mem_cache.allocator import KVAllocator
from runtime.mem_cache.block_hash import page_hashes
from runtime.mem_cache.cache_event_log import CacheEventLog
from runtime.mem_cache.radix_cache import RadixCache
from runtime.messages import GenerateRequest, LinkSubmit
from runtime.sampling.params import SamplingParams

PAGE = 4
A, B = (0, "a"), (0, "b")  # the base model's namespaces under salts "a" and "b"


def _store(cache: RadixCache, tokens: list[int], namespace=0) -> torch.Tensor:
    """One finished request's KV into the cache, as KVCacheManager does (match, lock, insert, unlock)."""
    m = cache.match_prefix(tokens, namespace)
    cache.inc_lock_ref(m.last_node)
    cached = m.kv_indices.numel()
    kv = torch.cat([m.kv_indices, cache.allocator.alloc(len(tokens) - cached)])
    present = cache.insert(tokens, kv, namespace)
    cache.allocator.free(kv[cached:present])
    cache.dec_lock_ref(m.last_node)
    return kv


def _accounted(cache: RadixCache) -> bool:
    return cache.allocator.available_size() + cache.total_size() == cache.allocator.size


def test_match_and_insert_stay_within_a_salt():
    cache = RadixCache(KVAllocator(64))
    toks = list(range(10, 22))
    kv_a = _store(cache, toks, A)
    assert cache.match_prefix(toks, A).kv_indices.tolist() == kv_a.tolist()
    for other in (B, 0, 1, (1, "a")):  # another salt, no salt, an adapter, an adapter under the same salt
        assert cache.match_prefix(toks, other).kv_indices.numel() == 0, other
    # The unsalted request stores its own copy: nothing of salt a's slots is shared or freed.
    kv_none = _store(cache, toks)
    assert not set(kv_none.tolist()) & set(kv_a.tolist())
    assert cache.insert(toks, kv_none) == len(toks)  # now present in the unsalted tree
    assert cache.match_prefix(toks + [99], A).kv_indices.tolist() == kv_a.tolist()
    assert cache.total_size() == 2 * len(toks) and _accounted(cache)


def test_one_lru_over_every_salt_and_empty_salts_leave_no_root():
    cache = RadixCache(KVAllocator(64))
    a, b, none = [1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 4, 5, 7]
    kv_a, kv_b, _ = _store(cache, a, A), _store(cache, b, B), _store(cache, none)
    cache.match_prefix(a, A)  # salt a's path is now the most recent: salt b's goes first
    assert cache.evict(1) == len(b) and cache.match_prefix(b, B).kv_indices.numel() == 0
    assert B not in cache._roots  # its tree's last node went: so did its root
    cache.match_prefix(b, B)  # a lookup under a salt with no tree makes none (a salt per user stays bounded)
    assert B not in cache._roots
    assert cache.evict(1) == len(none)  # then the unsalted one, older than a's refreshed path
    assert cache.match_prefix(a, A).kv_indices.tolist() == kv_a.tolist()
    # A lock on salt a's prefix keeps it through an eviction of everything
    m = cache.match_prefix(a, A)
    cache.inc_lock_ref(m.last_node)
    assert cache.evict(100) == 0 and cache.protected_size() == len(a)
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(100) == len(a) and cache.total_size() == 0 and _accounted(cache)
    assert set(cache._roots) == {0}
    assert kv_b.numel() == len(b)


def test_reset_frees_every_salt():
    cache = RadixCache(KVAllocator(32))
    for ns in (0, A, B, (2, "a")):
        _store(cache, [7, 8, 9], ns)
    cache.reset()
    assert cache.allocator.available_size() == 32 and set(cache._roots) == {0}
    assert cache.match_prefix([7, 8, 9], A).kv_indices.numel() == 0


def test_routing_log_names_salted_prefixes_by_salted_hashes():
    log = CacheEventLog(page=PAGE)
    cache = RadixCache(KVAllocator(64), events=log)
    toks = list(range(3, 15))  # three full pages
    plain, salted = page_hashes(toks, page=PAGE), page_hashes(toks, page=PAGE, salt="a")
    assert not set(plain) & set(salted) and salted != page_hashes(toks, page=PAGE, salt="b")
    assert page_hashes(toks, page=PAGE, salt="\ud800") != plain  # a lone surrogate hashes too
    _store(cache, toks, A)
    assert log.held() == set(salted)  # what a gateway computes for the salted prompt (ray_engine_client)
    _store(cache, toks, (1, "a"))  # an adapter's trees are not reported, salted or not
    assert log.held() == set(salted)
    _store(cache, toks)
    assert log.held() == set(salted) | set(plain)
    cache.match_prefix(toks)  # the unsalted path is the most recent: the salted one goes first
    cache.evict(1)
    assert cache.match_prefix(toks, A).kv_indices.numel() == 0 and log.held() == set(plain)


def test_empty_or_non_string_salt_is_refused():
    limits = RequestLimits(context_len=64, vocab_size=100, kv_size=128)

    def req(salt: object) -> GenerateRequest:
        return GenerateRequest(rid="r", input_ids=(1, 2, 3), sampling_params=SamplingParams(max_new_tokens=2),
                               cache_salt=salt)

    for bad in ("", 5, b"a"):
        with pytest.raises(InvalidRequestError, match="cache_salt") as e:
            validate_request(limits, req(bad))
        assert e.value.param == "cache_salt"
    assert validate_request(limits, req("tenant-1")).cache_salt == "tenant-1"
    # Across the Ray link the salt travels with the request.
    raw = msgspec.msgpack.encode(LinkSubmit(req("t")))
    assert msgspec.msgpack.decode(raw, type=LinkSubmit).req.cache_salt == "t"


# ---- the running engine ----------------------------------------------------------------------------------
N = 6
PROMPT = [5, 9, 13, 40, 22, 7, 31, 18, 44, 3, 27, 11, 60, 2, 17, 8, 33, 12, 90, 4]
SP = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):
    # Chunked: a salted prompt's chunks go into its own tree as they finish (KVCacheManager.cache_unfinished).
    e = Engine(str(tiny_llama), device="cpu", dtype="float32", max_total_tokens=1024, log_level="warning",
               chunked_prefill_size=8)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def want(tiny_llama: Path) -> list[int]:
    return hf_greedy_ids(tiny_llama, PROMPT, N)


def _pool_full(e: Engine) -> bool:
    kv = e.scheduler.kv
    return kv.allocator.available_size() + kv.cache.evictable_size() == kv.size and kv.cache.protected_size() == 0


@pytest.mark.parametrize("first,second,shared", [("a", "a", True), ("a", "b", False), ("a", None, False),
                                                 (None, "a", False), (None, None, True)])
def test_same_prompt_shares_kv_only_under_the_same_salt(engine, want, first, second, shared):
    engine.scheduler.kv.flush()  # each case starts from an empty cache
    one = engine.generate(input_ids=PROMPT, sampling_params=SP, cache_salt=first)
    two = engine.generate(input_ids=PROMPT, sampling_params=SP, cache_salt=second)
    assert one["output_ids"] == want and two["output_ids"] == want
    assert one["usage"]["cached_tokens"] == 0
    assert two["usage"]["cached_tokens"] == (len(PROMPT) - 1 if shared else 0)
    engine.scheduler.check_kv_invariant()
    assert _pool_full(engine)


def test_salts_per_prompt_and_refusals(engine, want):
    engine.scheduler.kv.flush()
    engine.generate(input_ids=PROMPT, sampling_params=SP, cache_salt="x")
    outs = engine.generate(input_ids=[PROMPT, PROMPT], sampling_params=SP, cache_salt=["y", "x"])
    assert [o["output_ids"] for o in outs] == [want, want]
    assert [o["usage"]["cached_tokens"] for o in outs] == [0, len(PROMPT) - 1]
    for bad, message in (("", "non-empty string"), (["x"], "cache_salt: 1 given for 2 prompts")):
        with pytest.raises(InvalidRequestError, match=message) as e:
            engine.generate(input_ids=[PROMPT, PROMPT] if isinstance(bad, list) else PROMPT, sampling_params=SP,
                            cache_salt=bad)
        assert e.value.param == "cache_salt"
    engine.scheduler.check_kv_invariant()
    assert _pool_full(engine)
