"""TopKRouter: a MoE layer's gate, as HF's Mixtral / Qwen2-MoE / Qwen3-MoE routers compute it.

logits = x G^T in the model dtype, softmax over the experts in fp32, the top k of those probabilities,
renormalized to sum to 1 where the model asks (Mixtral always; Qwen per norm_topk_prob), then cast back to
the model dtype (Qwen) or kept in fp32 (Mixtral). The gate is small ([E, H]) and replicated on every rank:
each rank routes its tokens the same way, so the experts' TP shards agree."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 weights_fp32: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts {num_experts}]")
        self.top_k, self.renormalize, self.weights_fp32 = top_k, renormalize, weights_fp32
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H] → (routing weights [M, k], expert ids [M, k] int64)."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.weights_fp32 else weights.to(logits.dtype)), ids
