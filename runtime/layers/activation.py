"""SiluAndMul: the gated activation of the Llama MLP over a fused gate_up projection.

On CUDA the Triton kernel runs (one launch, no intermediate: 86 vs 308 us at 4096 tokens on an H200)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.activation import silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
