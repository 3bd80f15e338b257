"""FP8 (float8_e4m3fn) linear layers: per-output-channel weight scales, dynamic per-token activation scales.

y = (x8 * sx) @ (w8 * sw)^T, with x8 = saturate(x / sx), sx = amax(|x| over the row) / 448 per token and
sw per output channel (from the checkpoint, or amax / 448 when a bf16 checkpoint is quantized at load).
The GEMM is torch._scaled_mm where it takes row-wise scales (CUDA sm89+ with bf16 outputs, and torch's
CPU build); elsewhere the same arithmetic is emulated (dequantize both operands to the activation dtype,
then matmul), so every device computes the same quantized model. On CUDA sm89+ the activation quantize is
one Triton launch (kernels/fp8_act_quant.py, the same bits as quantize_per_token's eight torch ops; the
down projection's also applies SiLU-and-mul; bit-equal to the torch ops on an H100, GPU test), on with the
decode fusions; SHOAL_FP8_ACT_QUANT=0 or SHOAL_DECODE_FUSION=0 restores the torch ops.

--fp8-weight-only (use_fp8_forward's weight_only) keeps activations unquantized at every M: the GEMV where it
serves, and above it (and on CPU) its torch reference (weight dequantized to fp32, x in its own dtype, fp32
accumulate, one rounding): the w8a16 arithmetic, more accurate (benchmarks/README.md, FP8) and, without a
w8a16 GEMM kernel for large M, slower there. On CPU it is how bench_fp8_accuracy measures what the GEMV
serves at M <= 2 on a GPU; without it CPU runs the w8a8 path served above M 2.

--fp8-act-terms 2 keeps the w8a8 GEMM but gives it each activation row twice: its e4m3 rounding, then the
rounding of what that missed (quantize_per_token_two_term), as 2M rows of one GEMM whose halves are added:
the weight is still read once (decode stays memory-bound) and the activations keep ~7 significant bits,
which in an emulation on SmolLM2 recovered all of w8a8's loss against w8a16 (95.26 vs 95.29% top-1;
fp8_weight_error_sources_two_term_cpu.json). On CUDA the one-launch quantize writes both terms
(kernels/fp8_act_quant.py, two_term: the same bits as quantize_per_token_two_term).

Both forwards replace the instance's forward after load, like cpu_linear's packed weights; the parameters
keep their names (weight, now fp8; weight_scale [out, 1] fp32), so TP sharding is unchanged: column
layers shard the scales with their rows, row layers keep every output channel and its scale."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import MethodType

import torch
from torch import nn

from kernels.decode_fusion import decode_fusion_enabled
from kernels.fp8_act_quant import quantize_per_token_fp8
from kernels.fp8_gemv import (  # fp8gemv hook (issue 16)
    WEIGHT_ONLY_M_MAX,
    fp8_linear_small_m,
    fp8_linear_small_m_ref,
    gated_serves,
    use_small_m,
)
from kernels.norm_input import NormInput
from runtime.layers.linear import ColumnParallelLinear, RowParallelLinear

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_AMAX = 1e-12  # an all-zero row keeps a finite scale


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → (fp8 [N, K], fp32 scale [N, 1]) with w ≈ w8 * scale."""
    scale = w.float().abs().amax(dim=1, keepdim=True).clamp_(min=_MIN_AMAX) / FP8_MAX
    return (w.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (fp8 [M, K], fp32 scale [M, 1]): one scale per row (token). The scale multiplies by the
    fp32 reciprocal of 448 (what CUDA computes for `/ 448.0`; CPU would divide), so every device and the
    one-launch kernel (kernels/fp8_act_quant.py) produce the same bits."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_(min=_MIN_AMAX) * (1.0 / FP8_MAX)
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_token_two_term(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (fp8 [2M, K], fp32 scale [2M, 1]): rows 0..M-1 are quantize_per_token(x), rows M..2M-1 the
    same of its residual x - q1 * s1 (fp32), so x ~ q1 s1 + q2 s2 with ~7 significant bits where one term
    keeps 4. One GEMM over the 2M rows reads the weight once; the two halves of its output are summed."""
    xq1, s1 = quantize_per_token(x)
    resid = x.float() - xq1.float() * s1
    xq2, s2 = quantize_per_token(resid)
    return torch.cat([xq1, xq2]), torch.cat([s1, s2])


def scaled_mm_supported(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm takes row-wise scales here: CUDA needs sm89+ and a bf16 output."""
    if device.type == "cuda":
        return out_dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def act_quant_kernel_enabled() -> bool:
    """On unless SHOAL_FP8_ACT_QUANT=0: bit-equal to the torch ops on CPU (interpreter) and on an H100
    (tests/gpu/test_fp8_act_quant_gpu.py); the switch stays for A/B runs."""
    return os.environ.get("SHOAL_FP8_ACT_QUANT", "1").strip().lower() not in ("0", "false", "off", "no")


def triton_act_quant_supported(device: torch.device) -> bool:
    """Whether the one-launch activation quantize can run here: CUDA sm89+ (Triton's e4m3 cast)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               use_scaled_mm: bool | None = None, fused_quant: bool | None = None,
               weight_only: bool = False, act_terms: int = 1) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ (w8 [N, K] fp8 * w_scale [N, 1])^T + bias → [..., N] in x's dtype.
    fused_quant: quantize x in one Triton launch (same bits as the torch ops); None asks the device and
    SHOAL_DECODE_FUSION (layers decide once, at load). weight_only: x is never quantized (w8a16).
    act_terms 2: x in two e4m3 terms (quantize_per_token_two_term), one GEMM over twice the rows."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    # fp8gemv hook (issue 16): decode-sized M on CUDA -> the w8a16 Triton GEMV
    if use_small_m(x2, w8, WEIGHT_ONLY_M_MAX if weight_only else None):
        return fp8_linear_small_m(x2, w8, w_scale, bias).view(*shape[:-1], w8.shape[0])
    if weight_only:  # the GEMV's arithmetic where the GEMV does not serve
        return fp8_linear_small_m_ref(x2, w8, w_scale, bias).view(*shape[:-1], w8.shape[0])
    if fused_quant is None:
        fused_quant = fused_act_quant_enabled(x.device)
    if x2.shape[0] == 0:
        y = x2.new_empty((0, w8.shape[0]))
    elif act_terms == 2:
        xq, xs = quantize_per_token_fp8(x2, two_term=True) if fused_quant else quantize_per_token_two_term(x2)
        y = _two_term_sum(_quantized_matmul(xq, xs, w8, w_scale, x.dtype, use_scaled_mm))
    else:
        xq, xs = quantize_per_token_fp8(x2) if fused_quant else quantize_per_token(x2)
        y = _quantized_matmul(xq, xs, w8, w_scale, x.dtype, use_scaled_mm)
    if bias is not None:  # kept apart: _scaled_mm's bias epilogue rounds once where this rounds twice
        y = y + bias
    return y.view(*shape[:-1], w8.shape[0])


def _two_term_sum(y: torch.Tensor) -> torch.Tensor:
    """The GEMM over [q1; q2] rows → (q1 s1 + q2 s2) W^T: its two halves added (in the output dtype)."""
    m = y.shape[0] // 2
    return y[:m] + y[m:]


def _quantized_matmul(xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                      dtype: torch.dtype, use_scaled_mm: bool | None) -> torch.Tensor:
    """(xq * xs) @ (w8 * w_scale)^T in `dtype`; _scaled_mm writes a fresh [M, N] tensor in `dtype` (no cast
    or copy after it), and both scales go in as views ([M, 1] and [1, N], contiguous)."""
    if use_scaled_mm is None:
        use_scaled_mm = scaled_mm_supported(xq.device, dtype)
    if use_scaled_mm:
        return torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=w_scale.view(1, -1), out_dtype=dtype)
    return fp8_linear_reference(xq, xs, w8, w_scale, dtype)


def fp8_linear_reference(xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """The emulated GEMM: both operands dequantized to `dtype`, one matmul (fp32 accumulate inside)."""
    return (xq.to(dtype) * xs.to(dtype)) @ (w8.to(dtype) * w_scale.to(dtype)).t()


def _column_forward(self: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    y = fp8_linear(x, self.weight, self.weight_scale, self.bias, self.use_scaled_mm, self.fused_act_quant,
                   self.weight_only, self.act_terms)
    return self.group.all_gather(y, dim=-1) if self.gather_output else y


def fp8_gemv_serves(x: torch.Tensor, w8: torch.Tensor, weight_only: bool) -> bool:
    """Whether fp8_linear takes the w8a16 GEMV for these activations (else w8a8, or the torch reference)."""
    return use_small_m(x.reshape(-1, x.shape[-1]), w8, WEIGHT_ONLY_M_MAX if weight_only else None)


def _column_gemv_serves(self: ColumnParallelLinear, x: torch.Tensor) -> bool:
    return fp8_gemv_serves(x, self.weight, self.weight_only)


def _column_gemv_normed(self: ColumnParallelLinear, x: torch.Tensor, norm: NormInput) -> torch.Tensor:
    return fp8_linear_small_m(x, self.weight, self.weight_scale, self.bias, norm=norm)


def _row_forward(self: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    y = fp8_linear(x, self.weight, self.weight_scale, None, self.use_scaled_mm, self.fused_act_quant,
                   self.weight_only, self.act_terms)
    return self._reduce(y)  # the all-reduce (or its deferral to the next norm), then the bias


def _row_forward_silu_mul(self: RowParallelLinear, gate_up: torch.Tensor,
                          act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """self(act_fn(gate_up)) for the MLP's down projection; where the GEMV serves at the smallest M
    (gated_serves) it applies SiLU-and-mul as it loads x, and where w8a8 serves the one-launch quantize
    applies it as it reads the row (the same bits either way, one launch less per layer). Between the two
    (GEMV at M > GATED_M_MAX) the SiLU-and-mul runs once, then the GEMV."""
    x2 = gate_up.reshape(-1, gate_up.shape[-1])
    small = use_small_m(x2, self.weight, WEIGHT_ONLY_M_MAX if self.weight_only else None)
    if small and gated_serves(x2.shape[0]):
        y = fp8_linear_small_m(x2, self.weight, self.weight_scale, gated=True)
    elif self.fused_act_quant and not self.weight_only and not small and x2.shape[0] > 0:
        two = self.act_terms == 2
        xq, xs = quantize_per_token_fp8(x2, gated=True, two_term=two)
        y = _quantized_matmul(xq, xs, self.weight, self.weight_scale, x2.dtype, self.use_scaled_mm)
        if two:
            y = _two_term_sum(y)
    else:
        return self.forward(act_fn(gate_up))
    return self._reduce(y.view(*gate_up.shape[:-1], -1))


def fused_act_quant_enabled(device: torch.device) -> bool:
    """Whether the w8a8 path quantizes activations in one Triton launch here (read once, at load)."""
    return decode_fusion_enabled() and act_quant_kernel_enabled() and triton_act_quant_supported(device)


def fp8_linear_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The tensor-parallel linear layers FP8 applies to (attention and MLP projections; never the
    embedding, and the LM head only with --fp8-lm-head, through ParallelLMHead.use_fp8)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]


def use_fp8_forward(module: nn.Module, act_dtype: torch.dtype, weight_only: bool = False,
                    act_terms: int = 1) -> None:
    """Swaps in the FP8 forward once the module holds an fp8 `weight` and its `weight_scale`; weight_only:
    activations are never quantized (w8a16 at every M); act_terms: e4m3 terms per activation on w8a8."""
    if act_terms not in (1, 2):
        raise ValueError(f"--fp8-act-terms must be 1 or 2, got {act_terms}")
    module.use_scaled_mm = scaled_mm_supported(module.weight.device, act_dtype)
    module.weight_only = weight_only
    module.act_terms = act_terms
    # read once at load, like every decode-path fusion: a captured CUDA graph never mixes the two paths
    module.fused_act_quant = fused_act_quant_enabled(module.weight.device)
    forward = _row_forward if isinstance(module, RowParallelLinear) else _column_forward
    module.forward = MethodType(forward, module)
    if isinstance(module, ColumnParallelLinear):  # the norm-in-GEMV path (ColumnParallelLinear.forward_normed)
        module._gemv_serves = MethodType(_column_gemv_serves, module)
        module._gemv_normed = MethodType(_column_gemv_normed, module)
    if isinstance(module, RowParallelLinear):  # LlamaMLP calls it for down_proj when decode fusion is on
        module.forward_silu_mul = MethodType(_row_forward_silu_mul, module)
