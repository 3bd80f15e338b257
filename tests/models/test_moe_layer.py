"""FusedMoE, TopKRouter and SparseMoeBlock against a naive per-token loop over HF-layout expert tensors,
their TP=2 shards (the partial sums of the two ranks add up to the TP=1 output), and the loaders' errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.distributed import ParallelGroup
from runtime.errors import WeightLoadError
from runtime.layers.fused_moe import DOWN, GATE, UP, FusedMoE
from runtime.layers.moe_router import TopKRouter
from runtime.model_config import ModelConfig
from runtime.models.moe_block import SparseMoeBlock
from runtime.models.parallel_context import ParallelContext

E, H, INTER, SHARED, K = 6, 32, 24, 40, 2


def _experts(seed: int = 0) -> list[dict[int, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{GATE: torch.randn(INTER, H, generator=g) * 0.2, UP: torch.randn(INTER, H, generator=g) * 0.2,
             DOWN: torch.randn(H, INTER, generator=g) * 0.2} for _ in range(E)]


def _fused(experts, group: ParallelGroup) -> FusedMoE:
    moe = FusedMoE(E, H, INTER, group, torch.float32)
    for e, parts in enumerate(experts):
        for part, t in parts.items():
            moe.weight_loader(moe.w2_weight if part == DOWN else moe.w13_weight, t, (e, part))
    return moe


def _naive(x, experts, weights, ids) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            p = experts[int(ids[t, j])]
            out[t] += weights[t, j] * (p[DOWN] @ (F.silu(p[GATE] @ x[t]) * (p[UP] @ x[t])))
    return out


def _routing(m: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, H, generator=g)
    weights, ids = torch.softmax(torch.randn(m, E, generator=g), -1).topk(K)
    return x, weights, ids


def test_sorted_experts_match_a_per_token_loop() -> None:
    experts = _experts()
    moe = _fused(experts, ParallelGroup.single())
    for m in (1, 5, 23):
        x, w, ids = _routing(m, seed=m)
        torch.testing.assert_close(moe(x, w, ids), _naive(x, experts, w, ids), rtol=1e-5, atol=1e-5)
    x, w, ids = _routing(0)
    assert moe(x, w, ids).shape == (0, H)


def test_tp2_shards_sum_to_the_whole() -> None:
    experts = _experts()
    x, w, ids = _routing(9)
    whole = _fused(experts, ParallelGroup.single())(x, w, ids)
    shards = [_fused(experts, ParallelGroup(rank=r, size=2)) for r in range(2)]
    assert shards[0].w13_weight.shape == (E, INTER, H) and shards[0].w2_weight.shape == (E, H, INTER // 2)
    torch.testing.assert_close(shards[0](x, w, ids) + shards[1](x, w, ids), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("renormalize", "fp32"), [(True, True), (False, False)])
def test_router_softmax_topk(renormalize: bool, fp32: bool) -> None:
    router = TopKRouter(H, E, K, renormalize, fp32, torch.bfloat16)
    router.weight.data.normal_()
    x = torch.randn(7, H, dtype=torch.bfloat16)
    weights, ids = router(x)
    probs = torch.softmax(F.linear(x, router.weight).float(), -1)
    ref_w, ref_ids = probs.topk(K)
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert torch.equal(ids, ref_ids)
    assert weights.dtype == (torch.float32 if fp32 else torch.bfloat16)
    torch.testing.assert_close(weights.float(), ref_w, rtol=1e-2, atol=1e-3)
    with pytest.raises(ValueError, match="top_k"):
        TopKRouter(H, E, E + 1, True)


def _qwen2_moe_config() -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 50, "hidden_size": H, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64, "num_experts": E,
        "num_experts_per_tok": K, "moe_intermediate_size": INTER, "shared_expert_intermediate_size": SHARED,
        "norm_topk_prob": False, "torch_dtype": "float32"})


def _block(cfg: ModelConfig, group: ParallelGroup, full: dict[str, torch.Tensor], experts) -> SparseMoeBlock:
    block = SparseMoeBlock(cfg, ParallelContext.tensor_parallel(group))
    block.gate.weight.data.copy_(full["gate"])
    block.shared_expert_gate.weight.data.copy_(full["shared_gate"])
    mlp = block.shared_expert
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, full["s_gate"], 0)
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, full["s_up"], 1)
    mlp.down_proj.weight_loader(mlp.down_proj.weight, full["s_down"])
    loaded = _fused(experts, group)
    block.experts.load_state_dict(loaded.state_dict())
    block.group = ParallelGroup.single()  # this rank's partial sums, unreduced (no process group here)
    return block


def test_shared_expert_block_matches_hf_semantics_and_shards() -> None:
    cfg = _qwen2_moe_config()
    experts = _experts(3)
    g = torch.Generator().manual_seed(4)
    full = {"gate": torch.randn(E, H, generator=g), "shared_gate": torch.randn(1, H, generator=g),
            "s_gate": torch.randn(SHARED, H, generator=g) * 0.2, "s_up": torch.randn(SHARED, H, generator=g) * 0.2,
            "s_down": torch.randn(H, SHARED, generator=g) * 0.2}
    x = torch.randn(11, H, generator=g)
    w, ids = torch.softmax(x @ full["gate"].T, -1).topk(K)  # norm_topk_prob false: not renormalized
    shared = full["s_down"] @ (F.silu(full["s_gate"] @ x.T) * (full["s_up"] @ x.T))
    ref = _naive(x, experts, w, ids) + torch.sigmoid(x @ full["shared_gate"].T) * shared.T
    torch.testing.assert_close(_block(cfg, ParallelGroup.single(), full, experts)(x), ref, rtol=1e-4, atol=1e-5)
    halves = [_block(cfg, ParallelGroup(rank=r, size=2), full, experts)(x) for r in range(2)]
    torch.testing.assert_close(halves[0] + halves[1], ref, rtol=1e-4, atol=1e-5)


def test_expert_loader_names_bad_tensors() -> None:
    moe = FusedMoE(E, H, INTER, ParallelGroup.single(), torch.float32)
    moe.w13_weight.hf_name = "model.layers.0.mlp.experts.2.gate_proj.weight"
    with pytest.raises(WeightLoadError, match=r"experts\.2\.gate_proj.*\(24, 31\)"):
        moe.weight_loader(moe.w13_weight, torch.zeros(INTER, H - 1), (2, GATE))
    with pytest.raises(WeightLoadError, match="expert 6 is out of range"):
        moe.weight_loader(moe.w13_weight, torch.zeros(INTER, H), (6, GATE))
    with pytest.raises(ValueError, match="moe_intermediate_size 24 is not divisible by tp size 5"):
        FusedMoE(E, H, INTER, ParallelGroup(rank=0, size=5))
