"""Fp8Gemv: weight-only FP8 (w8a16) GEMV / skinny GEMM for decode-sized M, and the same kernel for
16-bit weights at M = 1 (dense_linear_small_m).

y[M, N] = x[M, K] @ (w8[N, K].float() * w_scale[N, None]).T (+ bias), fp32 accumulation, output in x's
dtype. The fp8 weight is read once, K-contiguous (16-byte vector loads), widened in registers (e4m3 is
exact in bf16/fp16/fp32) and the per-channel scale is applied once per output after the K loop. The
activations stay in their own dtype: no per-token quantize kernel, and better accuracy than w8a8.

Why: at M = 1..16, cuBLASLt's fp8 GEMM plus the activation-quantize kernel are latency-bound (the 8B
decode step was slower in fp8 than in bf16); a GEMV that streams the weight bytes at HBM speed halves the
bf16 step's GEMM time.

Two inner formulations, picked per config: multiply + sum over a [BLOCK_M, BLOCK_N, BLOCK_K] register
tile (no tl.dot: best for M <= 4, and exact in the Triton interpreter), or tl.dot with M padded to 16
(tensor cores, for M up to 16). SPLIT_K > 1 writes fp32 partials and a second small kernel sums them,
scales, adds the bias and casts; it is used only where N alone gives too few blocks to fill the SMs.
Configs are picked by shape (no autotuning: nothing to benchmark at CUDA-graph capture or startup);
benchmarks/bench_fp8_gemv.py sweeps the alternatives on a GPU.

gated=True takes the MLP's fused gate_up output [M, 2K] and multiplies silu(gate) * up (computed in fp32,
rounded to x's dtype, exactly as kernels/activation.py stores it) as it loads each x tile: the down
projection without the SiLU-and-mul launch (kernels/decode_fusion.py), the same bits as the two kernels.

bf16/fp16 weights (no scale): at M = 1 cuBLAS reaches 2.2-2.9 TB/s on an H100 (o_proj's 4096x4096 the
slowest, plus a split-K reduce launch for qkv and down); this kernel with one 16 KB weight tile per step
(block_n 8, block_k 1024) streams every Llama-8B shape at 2.5-3.2 TB/s: 7% less time over a decode step's
linears and the LM head (benchmarks/bench_fp8_gemv.py, its dense_gemv rows). It
changes the summation order against cuBLAS (not its bits), so it is a kernel choice, not a decode
fusion: SHOAL_DENSE_GEMV_MAX_M (default 1; 0 turns it off) bounds the M it serves.

Under programmatic dependent launch (kernels/pdl.py, sm90+) the M = 1 kernel loads its first weight tile
before it waits for the previous kernel (PEEL; weights are constant), so the weight stream overlaps that
kernel's tail: with every Triton kernel of the step on PDL the bf16 bs-1 step went 6.02 → 5.50 ms on an
H100 (benchmarks/README.md). GemvConfig.peel forces the peeled loop without PDL (the CPU test of its bits).

NormInput (M = 1, plain GEMV only): the kernel takes rmsnorm(x [+ residual]) * g in x's place. Every
program first reads the whole row (L2-resident: the previous kernel just wrote it) for 1 / rms, then
normalises each x tile as it loads it, exactly as kernels/rmsnorm.py rounds it; one program stores the new
residual. The decode step at batch 1 loses its 64 norm launches and their round trips (the decoder layers'
`fuse_norm`, SHOAL_NORM_GEMV).

The Triton interpreter (TRITON_INTERPRET=1) loads float8_e4m3fn tensors and widens them exactly; only its
tl.dot on bf16 is wrong, so CPU tests use fp32/fp16 activations."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.norm_input import NormInput, check_norm, norm_rstd, normed_tile
from kernels.pdl import launch_options, pdl_enabled

FP8_DTYPES = (torch.float8_e4m3fn,)
# The default M bound of the dispatch; SHOAL_FP8_GEMV_MAX_M overrides it (0 turns it off). Any M is computed
# right (rows in tiles: _launch). FP8 8B decode step on one H100 (profile_decode, fusions on), GEMV vs w8a8
# with the one-launch activation quantize: bs 2 5.09 vs 5.48 ms, bs 4 7.39 vs 5.23, bs 8 6.22 vs 5.59,
# bs 16 6.33 vs 5.59 (benchmarks/results/profile_decode_fp8w_bs*_gemv_max*.json).
SMALL_M_MAX = 2
# --fp8-weight-only's bound: there the alternative is the dequantize-then-matmul reference, not w8a8's GEMM.
WEIGHT_ONLY_M_MAX = 16
DENSE_M_MAX = 1  # the same for 16-bit weights (SHOAL_DENSE_GEMV_MAX_M): measured ahead of cuBLAS at M = 1
# gated=True only while M is this small: every N block recomputes silu(gate) * up over all of K from twice
# the columns, so the redundant work grows with M x N blocks. FP8 8B at M = 32 with every linear on the
# GEMV (SHOAL_FP8_GEMV_MAX_M=64, one H100): 13.12 ms a decode step gated, 6.87 ms with the SiLU-and-mul
# launch apart (profile_decode_fp8w_bs32_64_gemv_max64.json); at M = 1 the gated launch saves one.
GATED_M_MAX = 4
DENSE_DTYPES = (torch.bfloat16, torch.float16)
SM_COUNT_DEFAULT = 132  # H100 SXM; used when the device cannot be asked (interpreter)
_SMEM_BUDGET = 96 * 1024  # bytes of pipelined tiles: an sm89 block has ~99 KB of shared memory, sm90 ~227 KB


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    use_dot: bool = False
    num_warps: int = 4
    num_stages: int = 3
    peel: bool | None = None  # load the first weight tile ahead of the loop (None: exactly when PDL is on)


@triton.jit
def _gate(x_ptrs, X, K, mask, GATED: tl.constexpr, MASKED: tl.constexpr):
    """The x tile: X itself, or silu(gate) * up with up K columns to the right (rounded like silu_and_mul)."""
    if MASKED:
        x = tl.load(x_ptrs, mask=mask, other=0.0)
    else:
        x = tl.load(x_ptrs)
    if GATED:
        if MASKED:
            up = tl.load(x_ptrs + K, mask=mask, other=0.0).to(tl.float32)
        else:
            up = tl.load(x_ptrs + K).to(tl.float32)
        gate = x.to(tl.float32)
        x = (gate * tl.sigmoid(gate) * up).to(X.dtype.element_ty)
    return x


@triton.jit
def _fp8_gemv_kernel(X, W, S, B, Out, Part, R, G, RO, eps, M, N, K, stride_xm, stride_wn, stride_om,
                     GATED: tl.constexpr, NORM: tl.constexpr, KFULL: tl.constexpr, HAS_SCALE: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PEEL: tl.constexpr, USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Each split owns a whole number of BLOCK_K tiles; EVEN_K says K == SPLIT_K * tiles * BLOCK_K exactly.
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    # M == 1 without tl.dot is the plain GEMV: x is a 1-D row broadcast over a 2-D weight tile, so both
    # take the weight load's layout (a [1, BLOCK_K] x tile would be re-laid out through shared memory).
    GEMV1: tl.constexpr = (not USE_DOT) and BLOCK_M == 1
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    if GEMV1:
        x_ptrs = X + k_lo + offs_k
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        x_ptrs = X + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
        if USE_DOT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    # PEEL (M == 1, whole tiles): the first weight tile is loaded before gdc_wait, so under PDL it streams
    # while the previous kernel finishes (weights are never written during a forward); same sum order.
    k_start = k_lo
    if PEEL:
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if NORM > 0:
            rstd = norm_rstd(X, R, RO, K, eps, (pid_n == 0) & (pid_k == 0), NORM, KFULL)
        x = _gate(x_ptrs, X, K, None, GATED, False)
        if NORM > 0:
            x = normed_tile(x, R, G, k_lo + offs_k, None, rstd, NORM, False)
        acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_start = k_lo + BLOCK_K
    else:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if NORM > 0:
            rstd = norm_rstd(X, R, RO, K, eps, (pid_n == 0) & (pid_k == 0), NORM, KFULL)
    for k in range(k_start, k_hi, BLOCK_K):
        if EVEN_K:
            if GEMV1:
                x = _gate(x_ptrs, X, K, None, GATED, False)
                if NORM > 0:
                    x = normed_tile(x, R, G, k + offs_k, None, rstd, NORM, False)
            else:
                x = _gate(x_ptrs, X, K, mask_m[:, None], GATED, True)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            mask_k = (k + offs_k) < k_hi
            if GEMV1:
                x = _gate(x_ptrs, X, K, mask_k, GATED, True)
                if NORM > 0:
                    x = normed_tile(x, R, G, k + offs_k, mask_k, rstd, NORM, True)
            else:
                x = _gate(x_ptrs, X, K, mask_m[:, None] & mask_k[None, :], GATED, True)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if GEMV1:
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
        elif USE_DOT:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
        else:
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if GEMV1:
        acc = tl.sum(acc2, axis=1)[None, :]
    elif not USE_DOT:
        acc = tl.sum(acc3, axis=2)
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        y = acc
        if HAS_SCALE:
            y = y * tl.load(S + offs_n, mask=mask_n, other=0.0)[None, :]
        if HAS_BIAS:
            y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], y.to(Out.dtype.element_ty), mask=out_mask)
    else:
        tl.store(Part + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(Part, S, B, Out, M, N, stride_om, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                           SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(Part + (s * M + m) * N + offs, mask=mask, other=0.0)
    y = acc
    if HAS_SCALE:
        y = y * tl.load(S + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs, y.to(Out.dtype.element_ty), mask=mask)


def device_sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return SM_COUNT_DEFAULT


def pick_config(m: int, n: int, k: int, sm_count: int = SM_COUNT_DEFAULT, weight_bytes: int = 1) -> GemvConfig:
    """The config for one shape. HBM latency needs ~16-32 KB of loads in flight per SM, so the weight tile
    stays ~4-8 KB and N is cut into >= 3 blocks per SM (narrower blocks before split-K, whose second
    kernel costs a launch); multiply + sum for M <= 4, tl.dot (M padded to 16, pipelined) above (served
    only where SHOAL_FP8_GEMV_MAX_M asks: the default bound is 2).
    16-bit weights (weight_bytes 2) keep the 8-row, 8192-element tile (16 KB): within 2% of the best of an
    H100 sweep (block_n 4-32, block_k 256-1024, split-K, warps, stages; an uncommitted experiment) on every
    Llama-8B shape, TP=2 halves included."""
    if m <= 4:
        block_n = 16 if weight_bytes == 1 and triton.cdiv(n, 16) >= 3 * sm_count else 8
        block_k = (8192 // block_n) // triton.next_power_of_2(m)  # a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 tile
        use_dot, stages = False, 2
    else:
        block_n, block_k, use_dot, stages = 16, 256, True, 4
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    split_k = 1
    while (triton.cdiv(n, block_n) * split_k < 2 * sm_count and split_k < 8
           and k % (2 * split_k * block_k) == 0):
        split_k *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, use_dot=use_dot, num_warps=4,
                      num_stages=stages)


def _check_operands(fn: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] * (2 if gated else 1):
        raise ValueError(f"{fn}: x {tuple(x.shape)} and w {tuple(w.shape)} do not multiply"
                         + (" (gated: x holds gate and up, 2K columns)" if gated else ""))
    if bias is not None and bias.numel() != w.shape[0]:
        raise ValueError(f"{fn}: bias has {bias.numel()} values for {w.shape[0]} output channels")


def _launch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
            config: GemvConfig | None, gated: bool, norm: NormInput | None = None) -> torch.Tensor:
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    cfg = config or pick_config(m, n, k, device_sm_count(x.device), w.element_size())
    if norm is not None:
        check_norm(norm, x, k, m != 1 or cfg.use_dot or gated)
    # Rows in tiles of BLOCK_M (a third grid axis; each tile streams the whole weight once): tl.dot takes
    # up to 64 rows a tile (16 at least), the multiply + sum register tile up to 16.
    pow2_m = triton.next_power_of_2(m)
    block_m = max(16, min(64, pow2_m)) if cfg.use_dot else min(16, pow2_m)
    stages = cfg.num_stages
    if cfg.use_dot:  # the pipelined x and weight tiles stay within an sm89 block's shared memory
        tile_bytes = cfg.block_k * (block_m * x.element_size() + cfg.block_n * w.element_size())
        while stages > 1 and stages * tile_bytes > _SMEM_BUDGET:
            stages -= 1
    part = (torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device) if cfg.split_k > 1
            else out)
    b = bias.contiguous() if bias is not None else None
    # Placeholder pointers where there is no scale or bias (the constexprs keep them unread).
    s_ptr = scale if scale is not None else (b if b is not None else out)
    b_ptr = b if b is not None else s_ptr
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, triton.cdiv(m, block_m))
    pdl = pdl_enabled(x)
    gemv1 = block_m == 1 and not cfg.use_dot
    even_k = k % (cfg.split_k * cfg.block_k) == 0
    peel = gemv1 and even_k and (pdl if cfg.peel is None else cfg.peel)
    r_ptr = g_ptr = ro_ptr = x
    if norm is not None:
        g_ptr = norm.weight
        if norm.residual is not None:
            r_ptr, ro_ptr = norm.residual, norm.residual_out
    _fp8_gemv_kernel[grid](
        x, w, s_ptr, b_ptr, out, part, r_ptr, g_ptr, ro_ptr, norm.eps if norm is not None else 0.0,
        m, n, k, x.stride(0), w.stride(0), out.stride(0), GATED=gated,
        NORM=0 if norm is None else (1 if norm.residual is None else 2), KFULL=triton.next_power_of_2(k),
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k,
        USE_DOT=cfg.use_dot, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EVEN_N=n % cfg.block_n == 0, EVEN_K=even_k,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PEEL=peel, USE_PDL=pdl,
        num_warps=cfg.num_warps, num_stages=stages, **launch_options(pdl),
    )
    if cfg.split_k > 1:
        block = min(1024, triton.next_power_of_2(n))
        _split_k_reduce_kernel[(triton.cdiv(n, block), m)](
            part, s_ptr, b_ptr, out, m, n, out.stride(0), HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
            SPLIT_K=cfg.split_k, BLOCK=block, USE_PDL=pdl, **launch_options(pdl))
    return out


def fp8_linear_small_m(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, config: GemvConfig | None = None,
                       gated: bool = False, norm: NormInput | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ (w8 [N, K] fp8 * w_scale [N])^T + bias → [M, N] in x's dtype.
    gated: x is [M, 2K] = cat(gate, up) and the product takes silu(gate) * up in its place.
    norm (M = 1): the product takes rmsnorm(x [+ norm.residual]) * norm.weight in x's place."""
    _check_operands("fp8_linear_small_m", x, w8, bias, gated)
    if w8.dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_linear_small_m: w8 must be float8_e4m3fn, got {w8.dtype}")
    n = w8.shape[0]
    scale = w_scale.reshape(-1).float()
    if scale.numel() == 1:
        scale = scale.expand(n)
    if scale.numel() != n:
        raise ValueError(f"fp8_linear_small_m: w_scale has {w_scale.numel()} values for {n} output channels")
    return _launch(x, w8, scale.contiguous(), bias, config, gated, norm)


def dense_linear_small_m(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                         config: GemvConfig | None = None, gated: bool = False,
                         norm: NormInput | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T + bias → [M, N] in x's dtype, for an unquantized weight (bf16/fp16 served,
    fp32 too for tests), fp32 accumulation; gated and norm as in fp8_linear_small_m."""
    _check_operands("dense_linear_small_m", x, w, bias, gated)
    if w.dtype in FP8_DTYPES:
        raise TypeError("dense_linear_small_m: an fp8 weight needs its scales (fp8_linear_small_m)")
    return _launch(x, w, None, bias, config, gated, norm)


def fp8_linear_small_m_ref(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                           bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """The torch reference: dequantize the weight to fp32, one fp32 matmul, then the bias, cast once
    (gated: silu(gate) * up first, in fp32 and rounded to x's dtype as kernels/activation.py does)."""
    if gated:
        gate, up = x.float().chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    w = w8.float() * w_scale.reshape(-1, 1).float()
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def gated_serves(m: int) -> bool:
    """Whether the GEMV should take the gate_up output itself (gated=True) at this M, rather than a
    separate SiLU-and-mul launch first (the same bits either way)."""
    return 1 <= m <= GATED_M_MAX


def norm_gemv_enabled() -> bool:
    """Whether a decode step at one row folds each decoder layer's RMSNorms into the GEMV after it
    (SHOAL_NORM_GEMV=1; off by default until its cost is measured on a GPU). A kernel choice, not an
    exact fusion: the prologue sums x^2 in the GEMV's layout (4 warps, the norm kernel 16), so 1 / rms may
    differ from the norm kernel's in its last bit, and then a normed value's rounding."""
    return os.environ.get("SHOAL_NORM_GEMV", "0").strip().lower() in ("1", "true", "on", "yes")


def small_m_max() -> int:
    """The largest M the dispatch sends to the GEMV (SHOAL_FP8_GEMV_MAX_M, default 16)."""
    return int(os.environ.get("SHOAL_FP8_GEMV_MAX_M", SMALL_M_MAX))


def dense_small_m_max() -> int:
    """The largest M the 16-bit weights' dispatch sends to the GEMV (SHOAL_DENSE_GEMV_MAX_M, default 1)."""
    return int(os.environ.get("SHOAL_DENSE_GEMV_MAX_M", DENSE_M_MAX))


def use_dense_small_m(x2: torch.Tensor, w: torch.Tensor, max_m: int) -> bool:
    """Whether an unquantized linear should take the GEMV: CUDA, 1 <= M <= max_m, a bf16/fp16 weight and
    activations of the same dtype (fp32 models keep cuBLAS: the GPU parity tests compare them bit-tight)."""
    return (x2.is_cuda and 1 <= x2.shape[0] <= max_m and w.dtype in DENSE_DTYPES and x2.dtype == w.dtype
            and w.is_cuda)


def use_small_m(x2: torch.Tensor, w8: torch.Tensor, max_m: int | None = None) -> bool:
    """Whether the fp8 linear should take the GEMV: CUDA sm89+, 1 <= M <= max_m, an fp8 weight and 16-bit
    or fp32 activations. CPU (and everything else) keeps the existing path."""
    limit = small_m_max() if max_m is None else max_m
    return (x2.is_cuda and w8.is_cuda and 1 <= x2.shape[0] <= limit and w8.dtype in FP8_DTYPES
            and x2.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and torch.cuda.get_device_capability(w8.device) >= (8, 9))  # Triton's e4m3 needs sm89+
