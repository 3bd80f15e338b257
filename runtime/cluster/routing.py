"""RoutingPolicy: which data-parallel replica (or DP-attention rank) gets a new request.

  round_robin   cycles over the live replicas
  least_load    the replica with the fewest running + waiting tokens (its scheduler stats, refreshed
                periodically, plus what was routed to it since)
  prefix_hash   consistent hashing of the first `prefix_tokens` prompt tokens, so requests that share a
                prefix (system prompt, few-shot examples) land where that prefix is cached; a dead
                replica's keys move to the next replica on the ring and come back when it does
  cache_aware   the replica whose prefix cache really holds the longest prefix of the prompt (each
                replica publishes its radix cache's inserts and evictions, see PrefixIndex), unless it
                is busier than the least loaded one by the balance thresholds: then the least loaded
"""

from __future__ import annotations

import hashlib
import itertools
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from runtime.cluster.prefix_index import PrefixIndex
from runtime.config import ServerArgs
from runtime.errors import EngineUnavailableError
from runtime.messages import GenerateRequest


@dataclass
class ReplicaLoad:
    """What a policy sees of one replica."""

    index: int
    alive: bool = True
    load: float = 0.0  # tokens: running + waiting per the last stats, plus routed since
    inflight: int = 0  # this client's requests on it now (exact: counted as they start and end)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)


class RoutingPolicy(ABC):
    wants_page_hashes = False  # pick() needs the prompt's page hashes (block_hash.page_hashes)

    def pick(self, req: GenerateRequest, replicas: Sequence[ReplicaLoad],
             hashes: Sequence[int] = ()) -> ReplicaLoad:
        live = [r for r in replicas if r.alive]
        if not live:
            raise EngineUnavailableError("no live replica to serve the request (all are down or restarting)")
        if self.wants_page_hashes:
            return self.choose(req, live, len(replicas), hashes)
        return self.choose(req, live, len(replicas))  # a policy written before hashes existed takes three

    @abstractmethod
    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int,
               hashes: Sequence[int] = ()) -> ReplicaLoad:
        """live: the alive replicas (never empty), in index order; hashes: the prompt's page hashes
        when the policy wants them."""


class RoundRobin(RoutingPolicy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int,
               hashes: Sequence[int] = ()) -> ReplicaLoad:
        return live[next(self._counter) % len(live)]


class LeastLoad(RoutingPolicy):
    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int,
               hashes: Sequence[int] = ()) -> ReplicaLoad:
        return min(live, key=lambda r: (r.load, r.index))


class PrefixHash(RoutingPolicy):
    def __init__(self, prefix_tokens: int = 32, virtual_nodes: int = 64):
        self.prefix_tokens, self.virtual_nodes = prefix_tokens, virtual_nodes
        self._ring_size = -1
        self._ring: list[tuple[int, int]] = []  # (hash point, replica index), sorted

    @staticmethod
    def _hash(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")

    def _build_ring(self, num_replicas: int) -> None:
        self._ring = sorted((self._hash(f"replica-{i}-{v}".encode()), i)
                            for i in range(num_replicas) for v in range(self.virtual_nodes))
        self._ring_size = num_replicas

    def key(self, input_ids: Sequence[int]) -> int:
        head = input_ids[:self.prefix_tokens]
        return self._hash(b"".join(t.to_bytes(4, "little", signed=False) for t in head))

    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int,
               hashes: Sequence[int] = ()) -> ReplicaLoad:
        if self._ring_size != num_replicas:
            self._build_ring(num_replicas)
        by_index = {r.index: r for r in live}
        start = bisect_left(self._ring, (self.key(req.input_ids), -1))
        for k in range(len(self._ring)):
            idx = self._ring[(start + k) % len(self._ring)][1]
            if idx in by_index:
                return by_index[idx]
        return live[0]


class CacheAware(RoutingPolicy):
    """Longest really-cached prefix wins (ties: the less loaded). Where the cache does not tell the
    replicas apart (a new prefix, or one every replica holds) the replica with the smallest cache among
    those about as idle as the least loaded takes it (SGLang's router takes the smallest tree), so new
    prefixes spread and each replica's share fits its pool without piling a burst on one replica.
    Either way, past the imbalance thresholds (in requests in flight, as the router's balance_abs/rel)
    the least loaded replica wins instead."""

    wants_page_hashes = True

    def __init__(self, balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.5):
        self.abs_threshold, self.rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.cache_routed = 0  # decisions made by the prefix cache
        self.load_routed = 0  # decisions made by cache size or load

    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int,
               hashes: Sequence[int] = ()) -> ReplicaLoad:
        least = min(live, key=_load_key)
        matched = {r.index: r.prefixes.matched_pages(hashes) for r in live} if hashes else {}
        best = max(live, key=lambda r: (matched.get(r.index, 0), -r.inflight, -r.load, -r.index))
        # A prefix every replica holds (a chat template's header) says nothing: only a longer one decides.
        by_cache = matched.get(best.index, 0) > min(matched.get(r.index, 0) for r in live)
        if not by_cache:  # the smallest cache among the replicas about as idle as the least loaded
            slack = 2 + least.inflight // 4
            near = [r for r in live if r.inflight <= least.inflight + slack]
            best = min(near, key=lambda r: (r.prefixes.size(), r.inflight, r.index))
        if self.imbalanced(best, least):
            best, by_cache = least, False
        if by_cache:
            self.cache_routed += 1
        else:
            self.load_routed += 1
        return best

    def imbalanced(self, busy: ReplicaLoad, least: ReplicaLoad) -> bool:
        return (busy.inflight - least.inflight > self.abs_threshold
                and busy.inflight > least.inflight * self.rel_threshold)


def _load_key(r: ReplicaLoad) -> tuple[int, float, int]:
    return r.inflight, r.load, r.index


ROUTING_POLICIES = MappingProxyType({"cache_aware": CacheAware, "round_robin": RoundRobin, "least_load": LeastLoad,
                                     "prefix_hash": PrefixHash})


def create_routing_policy(name: str, args: ServerArgs | None = None) -> RoutingPolicy:
    if name not in ROUTING_POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(ROUTING_POLICIES)}")
    if name == "cache_aware" and args is not None:
        return CacheAware(args.balance_abs_threshold, args.balance_rel_threshold)
    return ROUTING_POLICIES[name]()
