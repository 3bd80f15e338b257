"""DecodeGemm: y = x W^T (+ bias) for 16-bit weights at decode-batch M (tens to hundreds of rows).

At these M an 8B decode step's linears sit near the H100's ridge point (M = 256: the weights take ~5.3 ms
to stream, the FLOPs ~5.5 ms at the 700 W clock), where cuBLAS's picks reach 545 TFLOP/s over a step
(benchmarks/results/profile_decode_bs64_256_ctx400_h100.json). Two choices a general GEMM does not make:
- the M tiles of one N block are neighbours in the launch order, so the weight tile is read from HBM once
  and from L2 by the other M tiles;
- SWAP_AB computes (W x^T)^T: the weight rows are the MMA's M side (wgmma's 64-row granule) and the few
  tokens its N side (down to 16), so a 32-row batch does not pad to 64 rows of tensor-core work.
SPLIT_K > 1 writes fp32 partials that kernels/fp8_gemv's reduce kernel sums (narrow N: O, down).

Not wired into the model: benchmarks/sweep_decode_gemm.py timed its configs against cuBLAS on the 8B shapes
(one H100, decode_gemm_sweep_*_h100.json): 2-7% faster on some shapes at M = 32-64 (~0.2 ms of a decode
step), 10-35% slower at M >= 128, where a step's GEMM time is. It stays as that sweep's measured alternative.
decode_gemm_ref is the torch reference. Under the Triton interpreter tl.dot on bf16 is wrong: CPU tests use
fp32/fp16."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8_gemv import _split_k_reduce_kernel
from kernels.pdl import launch_options, pdl_enabled


@dataclass(frozen=True, slots=True)
class GemmConfig:
    block_m: int  # token rows a tile (SWAP_AB: the MMA's N side)
    block_n: int  # weight rows a tile
    block_k: int
    split_k: int = 1
    swap_ab: bool = False
    num_warps: int = 4
    num_stages: int = 4

    def smem_bytes(self, elem: int = 2) -> int:
        return self.num_stages * self.block_k * (self.block_m + self.block_n) * elem


@triton.jit
def _decode_gemm_kernel(X, W, B, Out, Part, M, N, K, stride_xm, stride_wn, stride_om,
                        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                        EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    # M tiles fastest: the programs sharing a weight tile run side by side and meet it in L2.
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % num_m
    pid_n = tl.program_id(0) // num_m
    pid_k = tl.program_id(1)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = X + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            mask_x = mask_m[:, None]
            mask_w = mask_n[:, None]
        else:
            mask_k = (k + offs_k) < k_hi
            mask_x = mask_m[:, None] & mask_k[None, :]
            mask_w = mask_n[:, None] & mask_k[None, :]
        if EVEN_M and EVEN_K:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=mask_x, other=0.0)
        if EVEN_N and EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=mask_w, other=0.0)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        y = acc
        if HAS_BIAS:
            y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], y.to(Out.dtype.element_ty), mask=out_mask)
    else:
        tl.store(Part + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=out_mask)


def decode_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T + bias -> [M, N] in x's dtype, fp32 accumulation (16-bit or fp32 weights)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"decode_gemm: x {tuple(x.shape)} and w {tuple(w.shape)} do not multiply")
    if w.element_size() == 1:
        raise TypeError("decode_gemm: 8-bit weights need their scales (kernels/fp8_gemv.py)")
    if bias is not None and bias.numel() != w.shape[0]:
        raise ValueError(f"decode_gemm: bias has {bias.numel()} values for {w.shape[0]} output channels")
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    cfg = config or pick_gemm_config(m, n, k)
    part = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device) if cfg.split_k > 1 else out
    b = bias.contiguous() if bias is not None else out
    pdl = pdl_enabled(x)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    _decode_gemm_kernel[grid](
        x, w, b, out, part, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k, SWAP_AB=cfg.swap_ab,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EVEN_M=m % cfg.block_m == 0, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % (cfg.split_k * cfg.block_k) == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl))
    if cfg.split_k > 1:
        block = min(1024, triton.next_power_of_2(n))
        _split_k_reduce_kernel[(triton.cdiv(n, block), m)](
            part, b, b, out, m, n, out.stride(0), HAS_SCALE=False, HAS_BIAS=bias is not None,
            SPLIT_K=cfg.split_k, BLOCK=block, USE_PDL=pdl, **launch_options(pdl))
    return out


def pick_gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """A general pick: swap-AB for up to 64 rows (the sweep's winners there), square tiles above."""
    if m <= 64:
        return GemmConfig(block_m=max(16, triton.next_power_of_2(m)), block_n=128, block_k=64, swap_ab=True)
    return GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)


def decode_gemm_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 torch reference of decode_gemm."""
    y = x.float() @ w.float().t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
