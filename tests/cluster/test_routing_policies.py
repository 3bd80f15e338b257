"""Routing policies without Ray: cache_aware follows the prefixes each replica reports holding (and
those just routed to it), sends a prefix no replica holds more of to the smallest cache, lets load
decide past the imbalance thresholds, and forgets a relaunched replica's cache; the registry builds every
policy; a dead replica is never picked; with none alive the error says so."""

from __future__ import annotations

import pytest

from runtime.cluster.prefix_index import PrefixIndex
from runtime.cluster.routing import ROUTING_POLICIES, CacheAware, ReplicaLoad, create_routing_policy
from runtime.config import ServerArgs
from runtime.errors import EngineUnavailableError
from runtime.mem_cache.block_hash import page_hashes
from runtime.messages import CacheEvents, GenerateRequest
from runtime.sampling.params import SamplingParams

SYSTEM_A = list(range(100, 164))  # 4 pages
SYSTEM_B = list(range(300, 364))


def req(ids: list[int]) -> GenerateRequest:
    return GenerateRequest(rid="r", input_ids=ids, sampling_params=SamplingParams())


def replicas(n: int = 2) -> list[ReplicaLoad]:
    return [ReplicaLoad(index=i) for i in range(n)]


def holds(r: ReplicaLoad, ids: list[int]) -> None:
    r.prefixes.apply(CacheEvents(seq=r.prefixes.seq + 1, stored=page_hashes(ids)))


def test_longest_cached_prefix_wins():
    policy, rs = CacheAware(), replicas(3)
    holds(rs[1], SYSTEM_A[:32])
    holds(rs[2], SYSTEM_A)
    prompt = SYSTEM_A + [7, 8, 9]
    assert policy.pick(req(prompt), rs, page_hashes(prompt)).index == 2
    rs[2].alive = False
    assert policy.pick(req(prompt), rs, page_hashes(prompt)).index == 1
    assert policy.cache_routed == 2


def test_no_distinguishing_prefix_goes_to_least_loaded():
    policy, rs = CacheAware(), replicas()
    rs[0].inflight, rs[1].inflight = 5, 2
    prompt = SYSTEM_B + [1]
    assert policy.pick(req(prompt), rs, page_hashes(prompt)).index == 1
    header = SYSTEM_A[:16]  # a prefix both hold (a chat template's header) does not decide
    holds(rs[0], header)
    holds(rs[1], header)
    prompt = header + SYSTEM_B
    assert policy.pick(req(prompt), rs, page_hashes(prompt)).index == 1
    assert policy.load_routed == 2 and policy.cache_routed == 0


def test_a_new_prefix_goes_to_the_smaller_cache():
    policy, rs = CacheAware(), replicas()
    holds(rs[0], SYSTEM_A)
    rs[0].inflight, rs[1].inflight = 0, 2  # fewer in flight, but a bigger cache
    prompt = SYSTEM_B + [1]
    assert policy.pick(req(prompt), rs, page_hashes(prompt)).index == 1
    rs[1].inflight = 3  # no longer about as idle: load decides
    assert policy.pick(req(prompt), rs, page_hashes(prompt)).index == 0
    assert policy.load_routed == 2


def test_imbalance_past_both_thresholds_routes_by_load():
    policy, rs = CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5), replicas()
    holds(rs[0], SYSTEM_A)
    prompt = SYSTEM_A + [1]
    rs[0].inflight, rs[1].inflight = 6, 2  # 4 more: not past the absolute threshold
    assert policy.pick(req(prompt), rs, page_hashes(prompt)).index == 0
    rs[0].inflight = 7  # 5 more and 3.5x: past both
    assert policy.pick(req(prompt), rs, page_hashes(prompt)).index == 1
    rs[0].inflight, rs[1].inflight = 40, 30  # 10 more but only 1.33x: the cache still decides
    assert policy.pick(req(prompt), rs, page_hashes(prompt)).index == 0


def test_routed_prefixes_count_until_the_request_leaves():
    """A burst of one new system prompt stays together before the replica has reported anything."""
    policy, rs = CacheAware(), replicas()
    first = SYSTEM_A + [1]
    hashes = page_hashes(first)
    target = policy.pick(req(first), rs, hashes)
    target.prefixes.route(hashes)
    target.inflight += 1
    second = SYSTEM_A + [2, 3]
    assert policy.pick(req(second), rs, page_hashes(second)) is target
    target.prefixes.unroute(hashes)
    target.inflight -= 1
    assert target.prefixes.matched_pages(page_hashes(second)) == 0  # nothing reported, nothing routed


def test_prefix_index_events_snapshot_and_reset():
    idx = PrefixIndex()
    a, b = page_hashes(SYSTEM_A), page_hashes(SYSTEM_B)
    idx.apply(CacheEvents(seq=3, stored=a, snapshot=True))
    assert idx.cached_pages(a) == 4 and idx.seq == 3
    idx.apply(CacheEvents(seq=5, stored=b, removed=a[2:]))
    assert idx.cached_pages(a) == 2 and idx.cached_pages(b) == 4
    idx.apply(CacheEvents(seq=6, stored=b[:1], snapshot=True))
    assert idx.cached_pages(a) == 0 and idx.cached_pages(b) == 1
    idx.route(a)
    idx.reset()
    assert idx.seq == -1 and idx.matched_pages(a) == 0 and idx.matched_pages(b) == 0


def test_registry_and_errors():
    args = ServerArgs(balance_abs_threshold=7, balance_rel_threshold=2.0)
    for name in ROUTING_POLICIES:
        assert create_routing_policy(name, args).pick(req([1, 2]), replicas()).alive
    p = create_routing_policy("cache_aware", args)
    assert isinstance(p, CacheAware) and (p.abs_threshold, p.rel_threshold) == (7, 2.0)
    assert ServerArgs().routing_policy == "cache_aware"
    with pytest.raises(ValueError, match="unknown routing policy"):
        create_routing_policy("random")
    dead = replicas()
    for r in dead:
        r.alive = False
    with pytest.raises(EngineUnavailableError, match="no live replica"):
        CacheAware().pick(req([1]), dead)
