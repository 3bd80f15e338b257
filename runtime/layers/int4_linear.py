"""Int4 linear layers: 4-bit weight-only (w4a16) forwards for the tensor-parallel linears.

A layer that runs it holds `qweight` [N, K/8] int32 (K-packed nibbles), `scales` [K/G, N] in the
checkpoint's dtype and `zeros` [K/G, N] uint8 or None (symmetric: zero point 8), the layout of
kernels/w4a16_gemm.py, on this rank's shard: column layers hold their output rows, row layers their input
columns in whole groups, every output channel (runtime/model_executor/int4_weights.py loads them).

On CUDA the packed weight stays packed and every call is kernels/w4a16_gemm (the Triton GEMV / GEMM up
to 64 rows, a quarter of bf16's weight bytes read per step; above, a dequantized copy of the layer and
cuBLAS); elsewhere the forward is its torch reference (the weight dequantized per call). CPU serving
does not take this path: Int4Weights dequantizes once at load there (plain 16/32-bit layers, which the CPU's
packed-weight forwards then serve); tests use it to run the packed layer itself.

The bf16 layers' decode shortcuts need a dense `weight`: the norm-in-GEMV prologue is declined
(_gemv_serves False, the caller runs the norm) and the down projection's SiLU-and-mul runs apart."""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType

import torch
from torch import nn

from kernels.w4a16_gemm import dequantize_int4, w4a16_gemm, w4a16_gemm_ref
from runtime.layers.linear import ColumnParallelLinear, RowParallelLinear


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group_size: int, bias: torch.Tensor | None = None, perm: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(W4)^T + bias → [..., N] in x's dtype: the Triton GEMM on CUDA, else the reference.
    perm (act order): the weight's columns are x's in this order."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if perm is not None:
        x2 = x2.index_select(1, perm)
    gemm = w4a16_gemm if x2.is_cuda else w4a16_gemm_ref
    return gemm(x2, qweight, scales, zeros, group_size, bias).view(*shape[:-1], qweight.shape[0])


def _column_forward(self: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    y = int4_linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias, self.act_perm)
    return self.group.all_gather(y, dim=-1) if self.gather_output else y


def _row_forward(self: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    # no bias here: _reduce adds it once, after the all-reduce (or the norm that takes the partial sums)
    return self._reduce(int4_linear(x, self.qweight, self.scales, self.zeros, self.group_size,
                                    perm=self.act_perm))


def _row_forward_silu_mul(self: RowParallelLinear, gate_up: torch.Tensor,
                          act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return self(act_fn(gate_up))


def _never_gemv(self: nn.Module, x: torch.Tensor) -> bool:
    return False


def use_int4_forward(module: nn.Module, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     group_size: int, perm: torch.Tensor | None = None) -> None:
    """Registers the packed tensors on `module` (its dense `weight` must be gone) and swaps in the w4a16
    forward; group_size is the K of one scale (K itself for per-channel scales); perm: act order's input
    column order (None: x as it comes)."""
    if "weight" in module._parameters:
        raise ValueError("use_int4_forward: the module still holds a dense weight")
    module.register_parameter("qweight", nn.Parameter(qweight, requires_grad=False))
    module.register_parameter("scales", nn.Parameter(scales, requires_grad=False))
    module.register_parameter("zeros", None if zeros is None else nn.Parameter(zeros, requires_grad=False))
    module.group_size = group_size
    module.register_buffer("act_perm", perm, persistent=False)
    module.forward = MethodType(_row_forward if isinstance(module, RowParallelLinear) else _column_forward, module)
    module._gemv_serves = MethodType(_never_gemv, module)
    if isinstance(module, RowParallelLinear):
        module.forward_silu_mul = MethodType(_row_forward_silu_mul, module)


def use_dequantized_weight(module: nn.Module, qweight: torch.Tensor, scales: torch.Tensor,
                           zeros: torch.Tensor | None, group_size: int, dtype: torch.dtype,
                           perm: torch.Tensor | None = None) -> None:
    """The CPU path: the module gets back a dense `weight` (the 4-bit values dequantized once, in `dtype`,
    its columns back in x's order where act order sorted them) and keeps its own forward."""
    w = dequantize_int4(qweight, scales, zeros, group_size).to(dtype)
    if perm is not None:
        w = torch.empty_like(w).index_copy_(1, perm, w)
    module.register_parameter("weight", nn.Parameter(w, requires_grad=False))


def int4_linear_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers a 4-bit checkpoint quantizes: every attention and MLP projection (never the embedding or
    the LM head)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
