"""Fp8ActQuant: dynamic per-token (per-row) float8_e4m3fn quantization of activations in one launch.

x [M, K] (bf16/fp16/fp32) → xq [M, K] float8_e4m3fn and xs [M, 1] float32 with
xs = max(amax(|x_row|), 1e-12) * (1/448) and xq = saturate(x / xs, ±448), the operands torch._scaled_mm
takes with row-wise scales.

Why: in torch ops this was eight launches per linear (x.float(), abs, amax, clamp, the scale multiply,
the divide, the clamp, the fp8 cast: 1,024 kernels and ~2.5 ms per 8B decode step at batch 32, which made
the FP8 step slower than bf16's). One program per row reads the row once, keeps it in registers (rows up to
16384 wide; wider rows take a second, L2-resident pass) and writes both outputs.

Bit-equal to runtime.layers.fp8_linear.quantize_per_token on every device: amax is exact whatever the
order, the scale is the same single fp32 multiply by fl32(1/448) (what CUDA's `amax / 448.0` computes: a
division by a CPU scalar runs as a multiply by its fp32 reciprocal), the division is IEEE (div_rn, not
Triton's approximate `/`), NaN propagates through the max and both clamps as torch's do, and the fp8 cast
rounds to nearest even on in-range values as c10 does.

gated=True takes the MLP's gate_up [M, 2K] and quantizes silu(gate) * up (computed in fp32 and rounded to
x's dtype exactly as kernels/activation.py stores it): the down projection's input without the SiLU-and-mul
launch (kernels/decode_fusion.py switches it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = tl.constexpr(448.0)
INV_FP8_MAX = tl.constexpr(1.0 / 448.0)  # fl32 of it is what CUDA multiplies by for torch's `/ 448.0`
MIN_AMAX = tl.constexpr(1e-12)  # an all-zero row keeps a finite scale
MAX_SINGLE_BLOCK = 16384  # widest row held in registers (16 warps x 32 values a thread)
LOOP_BLOCK = 4096


@triton.jit
def _load_row(x_ptrs, K, mask, GATED: tl.constexpr):
    """One block of the row in fp32: x itself, or silu(gate) * up rounded to x's dtype first."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if GATED:
        gate = x.to(tl.float32)
        up = tl.load(x_ptrs + K, mask=mask, other=0.0).to(tl.float32)
        x = (gate * tl.sigmoid(gate) * up).to(x_ptrs.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _round_to_e4m3(q):
    """q (fp32, |q| <= 448 or NaN) rounded to nearest even on the e4m3 grid, sign kept (-0.0 included), so
    the fp8 cast after it is exact: the same bits on the GPU's cvt and in the Triton interpreter, whose own
    fp32 -> e4m3 conversion drops the carry when rounding up crosses a power of two (127.9 -> 64)."""
    bits = q.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    mag = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3 subnormals keep 2^-6's spacing, 2^-9
    inv_ulp = ((130 - exp) << 23).to(tl.float32, bitcast=True)  # 2^(3 - exp): 3 mantissa bits
    ulp = ((exp + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exp - 3)
    r = (mag * inv_ulp + 12582912.0) - 12582912.0  # +- 1.5 * 2^23: round-to-nearest-even to an integer
    return ((r * ulp).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _rounded(x, scale):
    """x / scale saturated and rounded onto the e4m3 grid (fp32 values)."""
    q = tl.math.div_rn(x, scale)  # IEEE division like torch's; Triton's `/` on fp32 is approximate
    q = tl.clamp(q, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return _round_to_e4m3(q)


@triton.jit
def _quantize(x, scale, q_ptrs, mask):
    """Stores x's e4m3 codes; returns what they decode to (q * scale, fp32) for a second term."""
    q = _rounded(x, scale)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)
    return q * scale


@triton.jit
def _row_scale(amax):
    return tl.maximum(amax, MIN_AMAX, propagate_nan=tl.PropagateNan.ALL) * INV_FP8_MAX


@triton.jit
def _fp8_act_quant_kernel(X, Q, S, M, K, stride_xm, stride_qm, GATED: tl.constexpr, SINGLE_PASS: tl.constexpr,
                          TWO_TERM: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x_row = X + row * stride_xm
    q_row = Q + row * stride_qm
    q2_row = Q + (M + row) * stride_qm  # TWO_TERM: the residual's codes, M rows further down
    if SINGLE_PASS:
        mask = offs < K
        x = _load_row(x_row + offs, K, mask, GATED)
        amax = tl.reduce(tl.abs(x), 0, _max_nan)  # tl.max would drop NaN (maxnum); torch's amax keeps it
    else:
        acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            blk = _load_row(x_row + k + offs, K, (k + offs) < K, GATED)
            acc = tl.maximum(acc, tl.abs(blk), propagate_nan=tl.PropagateNan.ALL)
        amax = tl.reduce(acc, 0, _max_nan)
    scale = _row_scale(amax)
    tl.store(S + row, scale)
    if SINGLE_PASS:
        first = _quantize(x, scale, q_row + offs, mask)
        if TWO_TERM:
            resid = x - first
            scale2 = _row_scale(tl.reduce(tl.abs(resid), 0, _max_nan))
            tl.store(S + M + row, scale2)
            _quantize(resid, scale2, q2_row + offs, mask)
    else:
        if TWO_TERM:  # the residual's amax first (its codes need it), then both terms' codes
            acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                blk = _load_row(x_row + k + offs, K, (k + offs) < K, GATED)
                acc = tl.maximum(acc, tl.abs(blk - _rounded(blk, scale) * scale), propagate_nan=tl.PropagateNan.ALL)
            scale2 = _row_scale(tl.reduce(acc, 0, _max_nan))
            tl.store(S + M + row, scale2)
        for k in range(0, K, BLOCK_K):
            mask_k = (k + offs) < K
            blk = _load_row(x_row + k + offs, K, mask_k, GATED)
            first = _quantize(blk, scale, q_row + k + offs, mask_k)
            if TWO_TERM:
                _quantize(blk - first, scale2, q2_row + k + offs, mask_k)


def fp_fusion(two_term: bool) -> bool:
    """Whether Triton may fuse a multiply and an add into one FMA. Not with two terms: the residual
    x - q * s must round the product and the difference apart, as torch's two ops do (an FMA rounds once,
    so a residual could differ in its last bit). One term's only candidate, the rounding's mag * 2^k + c,
    has an exact product, so fused or not it gives the same bits."""
    return not two_term


def act_quant_config(k: int) -> tuple[int, bool, int]:
    """(BLOCK_K, single pass, num_warps) for a row of k values: ~16-32 values a thread, 4 to 16 warps."""
    block = max(16, triton.next_power_of_2(k))
    single = block <= MAX_SINGLE_BLOCK
    if not single:
        block = LOOP_BLOCK
    return block, single, max(4, min(16, block // 512))


def quantize_per_token_fp8(x: torch.Tensor, gated: bool = False,
                           two_term: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (fp8 [M, K], fp32 scale [M, 1]) in one launch; gated: x is [M, 2K] = cat(gate, up) and
    silu(gate) * up is quantized in its place. two_term: (fp8 [2M, K], scale [2M, 1]), rows M.. the
    rounding of each row's residual (runtime.layers.fp8_linear.quantize_per_token_two_term's bits)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_per_token_fp8: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"quantize_per_token_fp8: x must be bf16, fp16 or fp32, got {x.dtype}")
    if gated and x.shape[1] % 2 != 0:
        raise ValueError(f"quantize_per_token_fp8: gated x holds gate and up, but has {x.shape[1]} columns")
    m = x.shape[0]
    k = x.shape[1] // 2 if gated else x.shape[1]
    if k == 0:
        raise ValueError("quantize_per_token_fp8: x has no columns (a per-row amax needs at least one)")
    rows = 2 * m if two_term else m
    xq = torch.empty((rows, k), dtype=FP8, device=x.device)
    xs = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return xq, xs
    if x.stride(1) != 1:
        x = x.contiguous()
    block, single, warps = act_quant_config(k)
    _fp8_act_quant_kernel[(m,)](x, xq, xs, m, k, x.stride(0), xq.stride(0), GATED=gated, SINGLE_PASS=single,
                                TWO_TERM=two_term, BLOCK_K=block, num_warps=warps,
                                enable_fp_fusion=fp_fusion(two_term))
    return xq, xs
