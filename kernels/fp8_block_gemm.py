"""Fp8BlockGemm: the block-scaled w8a8 GEMM of block-wise FP8 checkpoints (Qwen3-*-FP8, DeepSeek-style
quantization_config.weight_block_size [bn, bk]), with its per-token-group activation quantize.

The weight w8 [N, K] float8_e4m3fn carries one fp32 scale per [bn, bk] block, scale_inv [ceil(N/bn),
ceil(K/bk)] (w ~ w8 * scale_inv per block); activations are quantized dynamically per token and per group
of bk columns, xq [M, K] fp8 with xs [M, ceil(K/bk)] fp32, so each bk-wide slice of the K loop is one fp8 dot
rescaled by its row's group scale and its column's block scale:

    y[m, n] = sum_kb xs[m, kb] * scale_inv[n // bn, kb] * (xq[m, kb-block] . w8[n, kb-block])   (fp32)

which is what vLLM / SGLang serve these checkpoints with (their w8a8_block_fp8_matmul and
per_token_group_quant_fp8); the Triton kernels here are written for Shoal, the arithmetic is the same.
Two Triton GEMMs: a GEMV for M 1 and an MMA kernel above it; from SCALED_MM_MIN_M rows on sm90, where torch
has it, cuBLASLt's blockwise GEMM (torch._scaled_mm with 1x128 / 128x128 scales: the same arithmetic).

Group scale: max(amax(|x_group|), 1e-12) * fl32(1/448), the codes x / scale saturated to +-448 and rounded
to nearest even: runtime.layers.fp8_linear.quantize_per_token's formula on each group, so the Triton quantize
and the torch reference give the same bits (the e4m3 rounding is kernels/fp8_act_quant's, exact in the
interpreter too). The torch references (dequantize both operands per block, one fp32 matmul) serve CPU and
GPUs without e4m3 dots (below sm89); they differ from the kernel only in fp32 summation order."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fp8_act_quant import _load_row, _max_nan, _rounded, _row_scale

FP8 = torch.float8_e4m3fn
_MIN_AMAX = 1e-12


def block_kernels_supported(device: torch.device) -> bool:
    """Whether the Triton kernels run here: CUDA sm89+ (e4m3 dots and casts)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# ---- per-token-group activation quantize ---------------------------------------------------------------

@triton.jit
def _group_quant_kernel(X, Q, S, K, groups, stride_xm, stride_qm, stride_sm, stride_sg, GROUP: tl.constexpr,
                        BLOCK: tl.constexpr, GROUPS_PER: tl.constexpr, GATED: tl.constexpr):
    """One row's GROUPS_PER groups as a [GROUPS_PER, BLOCK] tile: amax per tile row, scale, codes."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS_PER + tl.arange(0, GROUPS_PER)
    j = tl.arange(0, BLOCK)
    offs = g[:, None] * GROUP + j[None, :]
    mask = (j[None, :] < GROUP) & (offs < K)
    x = _load_row(X + row * stride_xm + offs, K, mask, GATED)
    scale = _row_scale(tl.reduce(tl.abs(x), 1, _max_nan))
    tl.store(S + row * stride_sm + g * stride_sg, scale, mask=g < groups)
    q = _rounded(x, scale[:, None])
    tl.store(Q + row * stride_qm + offs, q.to(Q.dtype.element_ty), mask=mask)


def per_token_group_quant_fp8(x: torch.Tensor, group: int, gated: bool = False,
                              rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (fp8 [M, K], fp32 scales [M, ceil(K/group)]) in one launch; the last group may be short.
    gated: x is the MLP's gate_up [M, 2K] and silu(gate) * up (rounded to x's dtype) is quantized.
    rows (>= M): both outputs get that many rows, the extra ones zero (codes) and one (scales), and the
    scales are column-major (stride 1 along M), the layout torch._scaled_mm's 1x128 blockwise scales take."""
    if x.dim() != 2:
        raise ValueError(f"per_token_group_quant_fp8: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if gated and x.shape[1] % 2:
        raise ValueError(f"per_token_group_quant_fp8: gated x holds gate and up, but has {x.shape[1]} columns")
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    groups = triton.cdiv(k, group)
    if rows is None:
        xq = torch.empty((m, k), dtype=FP8, device=x.device)
        xs = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    else:
        xq = torch.empty((rows, k), dtype=FP8, device=x.device)
        xs = torch.empty((groups, rows), dtype=torch.float32, device=x.device).t()
        if rows > m:  # padding rows: zero codes, unit scales (their outputs are sliced off)
            xq[m:].zero_()
            xs[m:].fill_(1.0)
    if m == 0 or k == 0:
        return xq, xs
    if x.stride(1) != 1:
        x = x.contiguous()
    block = triton.next_power_of_2(group)
    per = max(1, min(triton.next_power_of_2(groups), 2048 // block))
    _group_quant_kernel[(m, triton.cdiv(groups, per))](
        x, xq, xs, k, groups, x.stride(0), xq.stride(0), xs.stride(0), xs.stride(1), GROUP=group, BLOCK=block,
        GROUPS_PER=per, GATED=gated, num_warps=4 if per * block >= 1024 else 1)
    return xq, xs


def per_token_group_quant_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of per_token_group_quant_fp8 (the same bits)."""
    m, k = x.shape
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = xf.abs().amax(dim=2, keepdim=True).clamp_(min=_MIN_AMAX) * (1.0 / 448.0)
    xq = (xf / scale).clamp_(-448.0, 448.0).to(FP8).view(m, groups * group)[:, :k]
    return xq.contiguous(), scale.view(m, groups)


# ---- the block-scaled GEMM ---------------------------------------------------------------------------

@triton.jit
def _block_gemm_kernel(A, B, C, As, Bs, M, N, K, stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                       GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIZZLE_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # grouped launch order: SWIZZLE_M row tiles share each weight tile while it is in L2
    per_group = SWIZZLE_M * num_n
    first_m = (pid // per_group) * SWIZZLE_M
    rows_here = min(num_m - first_m, SWIZZLE_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # wrapped rows are computed and not stored
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = B + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    as_ptrs = As + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = Bs + (offs_n // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        ks = (kb * BLOCK_K) // GROUP_K
        a_s = tl.load(as_ptrs + ks)
        b_s = tl.load(bs_ptrs + ks)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = C + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _block_gemv_kernel(A, B, C, As, Bs, M, N, K, stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                       GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Decode-sized M (kernels/fp8_gemv's shape of loop): BLOCK_N weight rows of one block row (BLOCK_N
    divides GROUP_N), K-contiguous tiles widened in registers and multiplied by x's row with both scales
    folded in per column (xs[m, k // GROUP_K] * scale_inv[n // GROUP_N, k // GROUP_K]); products accumulate
    elementwise and are summed once after the K loop."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    w_ptrs = B + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :]
    bs_ptrs = Bs + (tl.program_id(0) * BLOCK_N // GROUP_N) * stride_bsn + offs_k // GROUP_K
    if BLOCK_M == 1:  # x a 1-D row broadcast over the weight tile: both keep the weight load's layout
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        b_s = tl.load(bs_ptrs + k0 // GROUP_K, mask=k_ok, other=0.0)
        if BLOCK_M == 1:
            a = tl.load(A + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            a_s = tl.load(As + (k0 + offs_k) // GROUP_K, mask=k_ok, other=0.0)
            acc2 += w * (a * a_s * b_s)[None, :]
        else:
            mk = m_ok[:, None] & k_ok[None, :]
            a = tl.load(A + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :], mask=mk, other=0.0)
            a_s = tl.load(As + offs_m[:, None] * stride_asm + ((k0 + offs_k) // GROUP_K)[None, :], mask=mk,
                          other=0.0)
            acc3 += (a.to(tl.float32) * a_s * b_s[None, :])[:, None, :] * w[None, :, :]
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    else:
        acc = tl.sum(acc3, axis=2)
    c_ptrs = C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


GEMV_M_MAX = 1  # the register-tile kernel's rows; above it the MMA kernel (at M 4 the GEMV was 3-4x slower)


def gemm_config(m: int, n: int, k: int, group_k: int) -> dict[str, int]:
    """The kernel and its tiles by shape, from a sweep on Qwen3-8B's projections on an H200
    (tests/gpu/test_gpu_fp8_block.py, SHOAL_FP8_BLOCK_SWEEP=1). M 1 reads the weight and little else: the
    GEMV kernel over many narrow programs (3.2-3.9 TB/s); up to 64 rows the MMA kernel on 16-64-row tiles;
    larger M 64-row tiles, 256 columns wide from 512 rows."""
    if m <= GEMV_M_MAX:
        wide = k <= 4096
        return dict(GEMV=1, BLOCK_M=1, BLOCK_N=16 if wide else 8, BLOCK_K=512 if wide else 1024, num_warps=4,
                    num_stages=1)
    block_k = min(group_k, 128)
    if m <= 16:
        if n <= 8192:
            return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, SWIZZLE_M=1, num_warps=2, num_stages=5)
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, SWIZZLE_M=1, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=32 if m <= 32 else 64, BLOCK_N=64, BLOCK_K=block_k, SWIZZLE_M=1, num_warps=4,
                    num_stages=4)
    if m <= 512:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=block_k, SWIZZLE_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=block_k, SWIZZLE_M=8, num_warps=8, num_stages=3)


def w8a8_block_fp8_matmul(xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, scale_inv: torch.Tensor,
                          block: tuple[int, int], out_dtype: torch.dtype,
                          config: dict[str, int] | None = None) -> torch.Tensor:
    """(xq [M, K] fp8, xs [M, ceil(K/bk)]) @ (w8 [N, K] fp8, scale_inv [ceil(N/bn), ceil(K/bk)])^T → [M, N]
    in out_dtype, fp32 accumulate. config overrides gemm_config's kernel and tiles (benchmarks, tests)."""
    bn, bk = block
    m, k = xq.shape
    n = w8.shape[0]
    if w8.shape[1] != k or xs.shape != (m, -(-k // bk)) or scale_inv.shape != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"w8a8_block_fp8_matmul: shapes x {tuple(xq.shape)} / {tuple(xs.shape)}, w "
                         f"{tuple(w8.shape)} / {tuple(scale_inv.shape)} do not fit block {block}")
    cfg = dict(config or gemm_config(m, n, k, bk))
    gemv = cfg.pop("GEMV", 0)
    if gemv:  # a program's rows share one block row
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], bn & -bn)
    if (not gemv and bk % cfg["BLOCK_K"]) or (gemv and cfg["BLOCK_M"] < m):
        raise ValueError(f"w8a8_block_fp8_matmul: tiles {cfg} do not fit {m} rows and {bk}-column groups")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    for t in (xq, w8, xs, scale_inv):
        if t.stride(-1) != 1:
            raise ValueError("w8a8_block_fp8_matmul: operands must be contiguous along their last dim")
    args = (xq, w8, out, xs, scale_inv, m, n, k, xq.stride(0), w8.stride(0), out.stride(0), xs.stride(0),
            scale_inv.stride(0))
    if gemv:
        _block_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](*args, GROUP_N=bn, GROUP_K=bk, **cfg)
    else:
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        _block_gemm_kernel[grid](*args, GROUP_N=bn, GROUP_K=bk, **cfg)
    return out


# ---- cuBLASLt's blockwise GEMM (torch._scaled_mm, DeepSeek's recipe) for large M --------------------------

# From this many rows torch._scaled_mm serves where it can: on an H200 it had a ~17 us floor (slower than
# the Triton kernels up to M 64) and from M 256 beat them on every Qwen3-8B projection (M 2048: 1.4-1.9x
# faster, 1.3-1.5x faster than bf16).
SCALED_MM_MIN_M = 65


def blockwise_scaled_mm_available(device: torch.device) -> bool:
    """Whether torch._scaled_mm takes 1x128 activation and 128x128 weight scales here (cuBLASLt 12.9+ on
    sm90 only, in torch 2.9+): probed once with a tiny GEMM (at load, never under graph capture).
    SHOAL_FP8_BLOCK_SCALED_MM=0 keeps the Triton kernels at every M (A/B runs)."""
    if os.environ.get("SHOAL_FP8_BLOCK_SCALED_MM", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        a = torch.zeros(4, 512, dtype=FP8, device=device)
        b = torch.zeros(128, 512, dtype=FP8, device=device)
        sa = torch.ones(4, 4, device=device).t().contiguous().t()
        torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=torch.ones(1, 4, device=device).t(), out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def scaled_mm_takes(w8: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether this weight fits the recipe: [128, 128] blocks, N a multiple of 128, K of 512 (cuBLASLt wants
    the K blocks in fours)."""
    return block == (128, 128) and w8.shape[0] % 128 == 0 and w8.shape[1] % 512 == 0


def w8a8_block_fp8_scaled_mm(x: torch.Tensor, w8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ the block-FP8 weight via torch._scaled_mm: x quantized per 128-column group into rows padded
    to a multiple of 4 with column-major scales (its 1x128 layout), the weight's scales as [K/128, N/128]."""
    m = x.shape[0]
    xq, xs = per_token_group_quant_fp8(x, 128, rows=-(-m // 4) * 4)
    return torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=scale_inv.t(), out_dtype=x.dtype)[:m]


def dequantize_blocks(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w8 [N, K] * its block scales → fp32 [N, K] (the checkpoint's w = w8 * weight_scale_inv)."""
    n, k = w8.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return w8.float() * s


def w8a8_block_fp8_matmul_ref(xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, scale_inv: torch.Tensor,
                              block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """The GEMM's torch reference: both operands dequantized per group / block, one fp32 matmul."""
    k = xq.shape[1]
    x = xq.float() * xs.float().repeat_interleave(block[1], 1)[:, :k]
    return (x @ dequantize_blocks(w8, scale_inv, block).t()).to(out_dtype)
