"""RMSNorm, plain and fused with the residual add (SGLang semantics), computed in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enabled


@triton.jit
def norm_row_entry(W, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """What a norm kernel starts with: the row's offsets and mask, the norm weight in fp32 (a weight, so
    safe to load ahead of the PDL wait), then the wait. Returns (offs, mask, w)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    return offs, mask, w


@triton.jit
def _rmsnorm_kernel(
    X, Residual, W, Out, stride_x, stride_r, stride_o, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs, mask, w = norm_row_entry(W, HIDDEN, BLOCK, USE_PDL)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the residual dtype before normalising, as an unfused add would round it,
        # so fused and unfused paths see the same residual stream.
        s = (x + r).to(Residual.dtype.element_ty)
        tl.store(Residual + row * stride_r + offs, s, mask=mask)
        x = s.to(tl.float32)
    variance = tl.sum(x * x, 0) / HIDDEN
    out = x * tl.rsqrt(variance + eps) * w
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, hidden] view sharing storage (in-place callers need writes to land in `t`)."""
    view = t.view(-1, t.shape[-1])
    if view.stride(-1) != 1:
        raise ValueError("tensor must be contiguous in its last dimension")
    return view


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., hidden] → x / rms(x) * weight, in x's dtype."""
    if out is None:
        out = torch.empty_like(x)
    x2, o2 = _rows(x), _rows(out)
    hidden = x.shape[-1]
    if x2.shape[0] > 0:
        pdl = pdl_enabled(x2)
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, x2, weight, o2, x2.stride(0), x2.stride(0), o2.stride(0), eps,
            HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden), ADD_RESIDUAL=False,
            USE_PDL=pdl, num_warps=_num_warps(hidden), **launch_options(pdl),
        )
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual = x + residual; x = rmsnorm(residual) * weight."""
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    x2, r2 = _rows(x), _rows(residual)
    hidden = x.shape[-1]
    if x2.shape[0] > 0:
        pdl = pdl_enabled(x2)
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, weight, x2, x2.stride(0), r2.stride(0), x2.stride(0), eps,
            HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden), ADD_RESIDUAL=True,
            USE_PDL=pdl, num_warps=_num_warps(hidden), **launch_options(pdl),
        )


def _num_warps(hidden: int) -> int:
    return max(1, min(16, triton.next_power_of_2(hidden) // 256))


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def fused_add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    residual.copy_((x.float() + residual.float()).to(residual.dtype))
    x.copy_(rmsnorm_ref(residual, weight, eps))
