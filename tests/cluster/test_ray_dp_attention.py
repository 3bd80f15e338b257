"""DP attention over 2 ranks (attention per rank, MLP split over both): with every request on rank 0 the
outputs equal the single-replica run, and rank 1 steps along with IDLE batches so the MLP collectives
match."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from ray_helpers import greedy, run_all

from runtime.cluster.routing import ReplicaLoad, RoutingPolicy
from runtime.config import ServerArgs
from runtime.messages import GenerateRequest

pytestmark = pytest.mark.ray


class RankZero(RoutingPolicy):
    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int) -> ReplicaLoad:
        return live[0]


def test_dp_attention_idle_rank(ray_local, tiny_llama):
    from runtime import Engine
    from runtime.cluster.launch import create_ray_engine_client

    prompts = [[5, 6, 7, 8, 9], [60, 61, 62, 63]]
    with Engine(str(tiny_llama), device="cpu", max_total_tokens=2048) as engine:
        expected = [engine.generate(input_ids=p, sampling_params={"max_new_tokens": 10, "temperature": 0})["output_ids"]
                    for p in prompts]
    client = create_ray_engine_client(ServerArgs(model_path=str(tiny_llama), dp_size=2, tp_size=2,
                                                 enable_dp_attention=True, device="cpu", max_total_tokens=2048))
    try:
        assert len(client.groups) == 1 and len(client.replicas) == 2  # one group, two routable ranks
        client.policy = RankZero()
        results = run_all(client, [GenerateRequest(rid=f"dpa{i}", input_ids=p, sampling_params=greedy(10))
                                   for i, p in enumerate(prompts)])
        assert [ids for ids, _ in results] == expected
        rank0, rank1 = client.replica_stats_sync()
        assert rank0.forward_modes["DECODE"].batches > 0 and rank0.cache_query_tokens == 9
        assert rank1.cache_query_tokens == 0 and rank1.forward_modes["EXTEND"].batches == 0
        # Rank 1 ran an IDLE batch for each step rank 0 did real work in.
        busy0 = sum(m.batches for k, m in rank0.forward_modes.items() if k != "IDLE")
        assert rank1.forward_modes["IDLE"].batches == busy0 > 0
    finally:
        client.shutdown()
