"""attach_lora: a LoraDelta on one projection, whichever forward its base weights run.

The 16-bit layers' class forwards add the term themselves (runtime/layers/linear.py). FP8, block-FP8 and
4-bit layers replace the instance's forward (use_fp8_forward, use_fp8_block_forward, use_int4_forward), so
here that forward is wrapped: the term runs in the activation dtype on the unquantized input x and adds to
the base output, as vLLM adds LoRA on a quantized base's 16-bit activations.

A row-parallel layer's term must join its partial sums before the all-reduce (and before the bias). Every
row forward ends in self._reduce(y) (linear.py, fp8_linear.py, fp8_block_linear.py, int4_linear.py), so the
wrapper keeps x for the duration of the call and the instance's _reduce adds the term to y first: no second
all-reduce, and the same arithmetic as the 16-bit layer's.

The fused decode paths that skip the module forward are declined as for 16-bit LoRA: the norm-in-GEMV
prologue (ColumnParallelLinear.forward_normed, never replaced, returns None while `lora` is set) and the
SiLU-folded down projection (an instance forward_silu_mul is replaced by the plain act-then-forward)."""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType

import torch
from torch import nn

from kernels.w4a16_gemm import PACK
from runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from runtime.lora.lora_layer import LoraDelta

Forward = Callable[[torch.Tensor], torch.Tensor]


def logical_shape(layer: nn.Module) -> tuple[int, int]:
    """(outputs, inputs) of this rank's projection: a dense or fp8 weight's own dims; a packed 4-bit layer's
    qweight [N, K/8] holds PACK inputs per int32."""
    weight = getattr(layer, "weight", None)
    if weight is not None:
        return weight.shape[0], weight.shape[1]
    qweight = getattr(layer, "qweight", None)
    if qweight is None:
        raise TypeError(f"{type(layer).__name__} holds neither a weight nor a 4-bit qweight")
    return qweight.shape[0], qweight.shape[1] * PACK


def attach_lora(module: ColumnParallelLinear | RowParallelLinear, delta: LoraDelta) -> None:
    """module.lora = delta, with its term added on whatever forward the module runs."""
    module.lora = delta
    row = isinstance(module, RowParallelLinear)
    if row and "forward_silu_mul" in module.__dict__:  # a quantized layer's SiLU-folded GEMV would skip the term
        module.forward_silu_mul = MethodType(_silu_mul_then_forward, module)
    base: Forward | None = module.__dict__.get("forward")
    if base is None:  # the class forward adds the term itself
        return
    if row:
        module.lora_input = None
        module._reduce = MethodType(_reduce_with_lora, module)
        module.forward = MethodType(_row_forward(base), module)
    else:
        if module.gather_output:  # the term is added to this rank's columns, before any gather
            raise ValueError("LoRA on a quantized column-parallel layer with gather_output is not supported")
        module.forward = MethodType(_column_forward(base), module)


def _column_forward(base: Forward) -> Callable[[ColumnParallelLinear, torch.Tensor], torch.Tensor]:
    def forward(self: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
        return self.lora(x, base(x))

    return forward


def _row_forward(base: Forward) -> Callable[[RowParallelLinear, torch.Tensor], torch.Tensor]:
    def forward(self: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
        self.lora_input = x  # read by _reduce_with_lora inside base(x)
        try:
            return base(x)
        finally:
            self.lora_input = None

    return forward


def _reduce_with_lora(self: RowParallelLinear, y: torch.Tensor) -> torch.Tensor:
    x = self.lora_input
    return RowParallelLinear._reduce(self, y if x is None else self.lora(x, y))


def _silu_mul_then_forward(self: RowParallelLinear, gate_up: torch.Tensor,
                           act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return self(act_fn(gate_up))
