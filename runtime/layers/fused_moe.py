"""FusedMoE: a MoE layer's routed experts (SwiGLU MLPs), their weights stacked per layer.

w13_weight [E, 2 * I / tp, H] holds each expert's gate rows then up rows, w2_weight [E, H, I / tp] its down
projection. Tensor parallelism shards every expert's intermediate dim, as vLLM does: each rank holds all
experts, a slice of each, and the down projection leaves partial sums that the caller all-reduces once
(with a shared expert's, SparseMoeBlock). The loader takes HF's per-expert tensors (experts.{e}.gate_proj
/ up_proj / down_proj, Mixtral's w1 / w3 / w2) into the stacks, shard_id (expert, part): 0 gate, 1 up, 2 down.

Compute: on CUDA the two grouped GEMMs of kernels/fused_moe.py (no host synchronization: the decode
step's CUDA graph captures it); elsewhere (CPU) tokens are sorted by expert and each expert that got any
runs its GEMMs on its tokens, the weighted results added back per token as HF's experts do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused_moe import fused_moe
from runtime.distributed import ParallelGroup
from runtime.errors import WeightLoadError
from runtime.layers.activation import SiluAndMul

GATE, UP, DOWN = 0, 1, 2


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, group: ParallelGroup,
                 dtype: torch.dtype | None = None):
        super().__init__()
        if intermediate_size % group.size:
            raise ValueError(f"moe_intermediate_size {intermediate_size} is not divisible by tp size {group.size}")
        self.group, self.num_experts = group, num_experts
        self.inter = intermediate_size // group.size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter, dtype=dtype),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        self.act_fn = SiluAndMul()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copies this rank's slice of one expert's full checkpoint tensor into its place in the stack."""
        expert, part = shard_id  # type: ignore[misc]
        name = getattr(param, "hf_name", "")
        if not 0 <= expert < self.num_experts:
            raise WeightLoadError(f"tensor {name}: expert {expert} is out of range (num_experts {self.num_experts})")
        dim = 1 if part == DOWN else 0  # gate/up split their output rows, down its input columns
        rows, cols = param.shape[1:]
        want = (rows, cols * self.group.size) if part == DOWN else (self.inter * self.group.size, cols)
        if tuple(loaded.shape) != want:
            raise WeightLoadError(f"tensor {name}: checkpoint shape {tuple(loaded.shape)}, expected {want}")
        src = loaded.narrow(dim, self.group.rank * self.inter, self.inter)
        dst = param.data[expert] if part == DOWN else param.data[expert].narrow(0, part * self.inter, self.inter)
        dst.copy_(src)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [M, H] → this rank's partial sums [M, H] of the routed experts (the caller all-reduces)."""
        if x.is_cuda:
            return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return self._forward_sorted(x, topk_weights, topk_ids)

    def _forward_sorted(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Each used expert's GEMMs on the tokens routed to it (host-side counts: eager only)."""
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens, weights = order // k, topk_weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            idx = tokens[start:start + count]
            y = F.linear(self.act_fn(F.linear(x[idx], self.w13_weight[expert])), self.w2_weight[expert])
            out.index_add_(0, idx, (y * weights[start:start + count, None]).to(out.dtype))
            start += count
        return out
