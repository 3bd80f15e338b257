"""Activation: SiLU-gated product for the MLP, silu(gate) * up from the fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enabled


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2I] = cat(gate, up) → silu(gate) * up [..., I], computed in fp32, stored in x's dtype."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"last dimension {x.shape[-1]} of x is not even")
    inter = x.shape[-1] // 2
    if out is None:
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, 2 * inter)
    out2 = out.view(-1, inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (x2.shape[0], triton.cdiv(inter, block))
    pdl = pdl_enabled(x2)
    _silu_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), INTER=inter, BLOCK=block, USE_PDL=pdl,
                               **launch_options(pdl))
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
