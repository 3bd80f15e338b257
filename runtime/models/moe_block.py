"""SparseMoeBlock: the MLP of a MoE decoder layer (Mixtral, Qwen2-MoE, Qwen3-MoE).

x → router (top-k experts per token) → the routed experts (FusedMoE), plus for Qwen2-MoE a shared expert
that every token takes, scaled by sigmoid(x · shared_expert_gate). Both leave this rank's partial sums
(each expert's intermediate dim is TP-sharded) and the block all-reduces their sum once, or leaves it to
the next RMSNorm where the decoder layer sets defer_to_norm (as RowParallelLinear does)."""

from __future__ import annotations

import torch
from torch import nn

from runtime.layers.fused_moe import FusedMoE
from runtime.layers.moe_router import TopKRouter
from runtime.model_config import ModelConfig
from runtime.models.llama import LlamaMLP
from runtime.models.parallel_context import ParallelContext


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext):
        super().__init__()
        moe = cfg.moe
        if moe is None:
            raise ValueError(f"{cfg.architecture}: a SparseMoeBlock needs the config's MoE fields")
        self.group = ctx.mlp
        self.defer_to_norm = False  # set by the decoder layer (LlamaDecoderLayer.norm_group)
        self.gate = TopKRouter(cfg.hidden_size, moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob,
                               moe.router_weights_fp32, cfg.dtype)
        self.experts = FusedMoE(moe.num_experts, cfg.hidden_size, moe.moe_intermediate_size, ctx.mlp, cfg.dtype)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(cfg, ctx, moe.shared_expert_intermediate_size, reduce_results=False)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, dtype=cfg.dtype)
            self.shared_expert_gate.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if not (self.defer_to_norm and self.group.defers_to_norm(y)):
            y = self.group.all_reduce(y)
        return y
