"""NormInput: a GEMV whose x is rmsnorm(x [+ residual]) * weight, the norm run in the GEMV's prologue.

The one-row GEMV (kernels/fp8_gemv.py) calls these two Triton helpers: norm_rstd reads the whole row once
(L2-resident: the previous kernel just wrote it) for 1 / rms and lets one program store the new residual;
normed_tile normalises each x tile as the GEMV loads it, rounding as kernels/rmsnorm.py stores its output.
The decoder layers use it at one row (SHOAL_NORM_GEMV): the batch-1 decode step loses its norm launches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class NormInput:
    """The GEMV's x is rmsnorm(x [+ residual]) * weight: the norm runs in its prologue (M = 1 only).
    residual_out receives x + residual (rounded, as fused_add_rmsnorm leaves it); without a residual
    it is unused."""
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None


def check_norm(norm: NormInput, x: torch.Tensor, k: int, unserved: bool) -> None:
    if unserved:
        raise ValueError("the norm prologue serves one row on the multiply + sum GEMV only")
    if norm.weight.numel() != k or not norm.weight.is_contiguous():
        raise ValueError(f"norm weight: {norm.weight.numel()} contiguous values wanted for {k} columns")
    if norm.residual is not None:
        for name, t in (("residual", norm.residual), ("residual_out", norm.residual_out)):
            if t is None or t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous():
                raise ValueError(f"norm {name} must be a contiguous {x.dtype} tensor shaped like x {tuple(x.shape)}")


@triton.jit
def norm_rstd(X, R, RO, K, eps, WRITE, NORM: tl.constexpr, KFULL: tl.constexpr):
    """The norm prologue (NORM 1: rmsnorm(x); 2: the residual add first, kernels/rmsnorm.py's rounding):
    1 / rms of the whole row, which every program reads (from L2: the previous kernel just wrote it).
    WRITE: this program stores the new residual (x + r, rounded) to RO; the others recompute it."""
    offs = tl.arange(0, KFULL)
    mask = offs < K
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM == 2:
        s = (x + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        if WRITE:
            tl.store(RO + offs, s, mask=mask)
        x = s.to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, 0) / K + eps)


@triton.jit
def normed_tile(x, R, G, k_offs, mask, rstd, NORM: tl.constexpr, MASKED: tl.constexpr):
    """The x tile as the norm kernel would have stored it: (x [+ r]) * rstd * g, rounded to x's dtype."""
    xf = x.to(tl.float32)
    if NORM == 2:
        if MASKED:
            r = tl.load(R + k_offs, mask=mask, other=0.0)
        else:
            r = tl.load(R + k_offs)
        xf = (xf + r.to(tl.float32)).to(x.dtype).to(tl.float32)
    if MASKED:
        g = tl.load(G + k_offs, mask=mask, other=0.0)
    else:
        g = tl.load(G + k_offs)
    return (xf * rstd * g.to(tl.float32)).to(x.dtype)
