"""TP=2 on Ray (CPU, gloo all-reduce) serves each tiny MoE architecture with the same greedy tokens as HF
transformers on the same fp32 weights (which the TP=1 Engine matches: tests/models/test_moe_hf_parity.py).
Each rank holds every expert's half of the intermediate dim (Qwen2-MoE: the shared expert's half too, its
gate replicated) and the sparse block's one all-reduce sums the routed and shared partials; Qwen2-MoE's and
Qwen3-MoE's dense layers shard as plain Llama MLPs. Layer-level shard sums are in tests/models/test_moe_layer.py;
this is the whole path: loader slicing per rank, routing on both ranks, batched prefill and decode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from ray_helpers import greedy, run_all

from runtime.config import ServerArgs
from runtime.messages import GenerateRequest

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from moe_tiny import MOE_ARCHS, make_tiny_moe  # noqa: E402

pytestmark = pytest.mark.ray

# Batched prefill of unequal lengths (the long one routes many tokens to every expert), then batched decode.
PROMPTS = [[5, 17, 33, 101, 250, 7, 9], [42], [(13 * i) % 380 + 4 for i in range(70)]]
NEW_TOKENS = 10
TP = 2


def _hf_greedy(path: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_tp2_matches_hf(ray_local, tmp_path, arch):
    from runtime.cluster.launch import create_ray_engine_client

    path = make_tiny_moe(arch, tmp_path / arch)
    cfg = json.loads((path / "config.json").read_text())
    keys = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
            "shared_expert_intermediate_size")  # Mixtral's experts are intermediate_size wide
    sizes = {k: cfg[k] for k in keys if k in cfg}
    assert all(v % TP == 0 for v in sizes.values()), f"{arch}: tiny config does not split over TP={TP}: {sizes}"
    expected = _hf_greedy(path)
    client = create_ray_engine_client(ServerArgs(model_path=str(path), tp_size=TP, device="cpu", dtype="float32",
                                                 max_total_tokens=1024))
    try:
        assert client.is_ready()
        assert len(client.groups[0].workers) == TP  # the follower rank runs its own shards, not a replica
        reqs = [GenerateRequest(rid=f"moe-{arch}-{i}", input_ids=p, sampling_params=greedy(NEW_TOKENS, ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
        results = run_all(client, reqs)
        for i, ((ids, last), want) in enumerate(zip(results, expected)):
            assert ids == want, f"{arch}: prompt {i} under TP={TP} gave {ids}, HF {want}"
            assert last.finished and last.completion_tokens == NEW_TOKENS
        assert client.replica_stats_sync()[0].forward_modes["DECODE"].batches > 0
    finally:
        client.shutdown()
