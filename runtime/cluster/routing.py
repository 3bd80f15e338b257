"""RoutingPolicy: which data-parallel replica (or DP-attention rank) gets a new request.

  round_robin   cycles over the live replicas
  least_load    the replica with the fewest running + waiting tokens (its scheduler stats, refreshed
                periodically, plus what was routed to it since)
  prefix_hash   consistent hashing of the first `prefix_tokens` prompt tokens, so requests that share a
                prefix (system prompt, few-shot examples) land where that prefix is cached; a dead
                replica's keys move to the next replica on the ring and come back when it does
"""

from __future__ import annotations

import hashlib
import itertools
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

from runtime.errors import EngineUnavailableError
from runtime.messages import GenerateRequest


@dataclass
class ReplicaLoad:
    """What a policy sees of one replica."""

    index: int
    alive: bool = True
    load: float = 0.0  # tokens: running + waiting per the last stats, plus routed since


class RoutingPolicy(ABC):
    def pick(self, req: GenerateRequest, replicas: Sequence[ReplicaLoad]) -> ReplicaLoad:
        live = [r for r in replicas if r.alive]
        if not live:
            raise EngineUnavailableError("no live replica to serve the request (all are down or restarting)")
        return self.choose(req, live, len(replicas))

    @abstractmethod
    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int) -> ReplicaLoad:
        """live: the alive replicas (never empty), in index order."""


class RoundRobin(RoutingPolicy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int) -> ReplicaLoad:
        return live[next(self._counter) % len(live)]


class LeastLoad(RoutingPolicy):
    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int) -> ReplicaLoad:
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

    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int) -> ReplicaLoad:
        if self._ring_size != num_replicas:
            self._build_ring(num_replicas)
        by_index = {r.index: r for r in live}
        start = bisect_left(self._ring, (self.key(req.input_ids), -1))
        for k in range(len(self._ring)):
            idx = self._ring[(start + k) % len(self._ring)][1]
            if idx in by_index:
                return by_index[idx]
        return live[0]


ROUTING_POLICIES = MappingProxyType({"round_robin": RoundRobin, "least_load": LeastLoad, "prefix_hash": PrefixHash})


def create_routing_policy(name: str) -> RoutingPolicy:
    try:
        return ROUTING_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(ROUTING_POLICIES)}") from None
