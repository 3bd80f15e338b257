"""Speculative decoding on Ray: the verify batch (drafts in its input ids, SpecInfo beside them) travels in
the one WorkerBatch broadcast, so TP rank 1 runs the same TARGET_VERIFY (and, for STANDALONE, the same
draft-model steps, its draft split over both ranks too); with DP attention the idle rank steps IDLE along
with each verify. Outputs equal the in-process plain Engine; the accept-length stats are per replica."""

from __future__ import annotations

import pytest
from ray_helpers import greedy, run_all

from runtime.config import ServerArgs
from runtime.messages import GenerateRequest

pytestmark = pytest.mark.ray

BASE = [23, 57, 91, 140, 7, 311, 62, 19]
PROMPTS = [BASE * 3, [5, 6, 7, 8, 9] * 2, [(7 * i) % 390 + 3 for i in range(40)]]


def _expected(path: str) -> list[list[int]]:
    from runtime import Engine

    with Engine(path, device="cpu", max_total_tokens=2048) as engine:
        return [o["output_ids"] for o in engine.generate(
            input_ids=PROMPTS, sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})]


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_tp2_speculative_matches_plain(ray_local, tiny_model_dirs, algo):
    from runtime.cluster.launch import create_ray_engine_client

    path = str(tiny_model_dirs["llama"])
    expected = _expected(path)
    extra = {"speculative_draft_model_path": path} if algo == "STANDALONE" else {}
    client = create_ray_engine_client(ServerArgs(model_path=path, tp_size=2, device="cpu", max_total_tokens=2048,
                                                 speculative_algorithm=algo, **extra))
    try:
        reqs = [GenerateRequest(rid=f"tp-{algo}-{i}", input_ids=p, sampling_params=greedy(16, ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
        assert [ids for ids, _ in run_all(client, reqs)] == expected
        stats = client.replica_stats_sync()[0]
        assert stats.forward_modes["TARGET_VERIFY"].batches > 0 and stats.spec_accept_length > 1.0
    finally:
        client.shutdown()


def test_dp_attention_idle_rank_steps_with_verify(ray_local, tiny_model_dirs):
    from test_ray_dp_attention import RankZero

    from runtime.cluster.launch import create_ray_engine_client

    path = str(tiny_model_dirs["llama"])
    expected = _expected(path)
    client = create_ray_engine_client(ServerArgs(model_path=path, dp_size=2, tp_size=2, enable_dp_attention=True,
                                                 device="cpu", max_total_tokens=2048, speculative_algorithm="NGRAM"))
    try:
        client.policy = RankZero()
        reqs = [GenerateRequest(rid=f"dpa-spec-{i}", input_ids=p, sampling_params=greedy(16, ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
        assert [ids for ids, _ in run_all(client, reqs)] == expected
        rank0, rank1 = client.replica_stats_sync()
        assert rank0.forward_modes["TARGET_VERIFY"].batches > 0 and rank0.spec_accept_length > 1.0
        busy0 = sum(m.batches for k, m in rank0.forward_modes.items() if k != "IDLE")
        assert rank1.forward_modes["IDLE"].batches == busy0 and rank1.spec_verify_reqs == 0
    finally:
        client.shutdown()
