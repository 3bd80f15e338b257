"""Routes a bf16 CPU model's RMSNorms, rotary embeddings and SiluAndMul through kernels/cpu_fused_ops.

The layers dispatch to Triton kernels when their tensors are on CUDA; on CPU they run eager torch (~30
small ops per decoder layer). This swaps the forward of those module instances, once after load, for
one fused C pass each, keeping the CUDA kernels' in-place contract (the fused residual add overwrites
x and residual; the rotary overwrites q and k). Anything not bf16 on CPU (fp32 models, the HF parity
tests) goes through the layer's own forward unchanged."""

from __future__ import annotations

import logging
from types import MethodType

import torch
from torch import nn

from kernels import cpu_fused_ops
from runtime.distributed.parallel_group import ParallelGroup
from runtime.layers.activation import SiluAndMul
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)


def _fits(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.stride(-1) == 1


def _rmsnorm_forward(self: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None,
                     group: ParallelGroup | None = None):
    # A group that defers its all-reduce to this norm (never on CPU today) takes RMSNorm's own path.
    if (not _fits(x) or (residual is not None and not (_fits(residual) and residual.is_contiguous()))
            or (group is not None and group.defers_to_norm(x))):
        return RMSNorm.forward(self, x, residual, group)
    if residual is None:
        return cpu_fused_ops.rmsnorm(x, self.weight, self.eps)
    cpu_fused_ops.fused_add_rmsnorm(x, residual, self.weight, self.eps)
    return x, residual


def _rotary_forward(self: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    if not (_fits(q) and _fits(k)) or self.cos_sin_cache.shape[-1] != self.head_dim:
        return RotaryEmbedding.forward(self, positions, q, k)
    cpu_fused_ops.rotary(positions, q, k, self.cos_sin_cache, self.head_dim)
    return q, k


def _silu_and_mul_forward(self: SiluAndMul, x: torch.Tensor) -> torch.Tensor:
    if not _fits(x):
        return SiluAndMul.forward(self, x)
    return cpu_fused_ops.silu_and_mul(x)


def fuse_cpu_layers(model: nn.Module) -> int:
    """Swaps in the fused forwards on a bf16 model's layers; returns how many modules changed."""
    params = list(model.parameters())
    if not params or params[0].dtype != torch.bfloat16 or params[0].device.type != "cpu":
        return 0
    if not cpu_fused_ops.available():
        return 0
    count = 0
    for module in model.modules():
        if (isinstance(module, RMSNorm) and module.weight.dtype == torch.bfloat16
                and module.weight.numel() <= cpu_fused_ops.MAX_HIDDEN):
            module.forward = MethodType(_rmsnorm_forward, module)
        elif isinstance(module, RotaryEmbedding):
            module.forward = MethodType(_rotary_forward, module)
        elif isinstance(module, SiluAndMul):
            module.forward = MethodType(_silu_and_mul_forward, module)
        else:
            continue
        count += 1
    logger.info("fused CPU kernels for %d norm/rotary/activation modules", count)
    return count
