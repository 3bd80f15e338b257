"""Per-head D x D transform in place: x[t, h, :] = x[t, h, :] @ mats[head_map[h]], one launch for every head
of a [T, H, D] strided view (the FP8 KV rotation's q, k and v in one go: they are adjacent heads of the
fused qkv projection's output, each with its own matrix).

One program per (block of BLOCK_T tokens, head): the [BLOCK_T, D] tile and its D x D matrix go through
tl.dot with fp32 accumulation, and the result is stored back over the tile it was read from (no other
program touches that tile, so in place is safe). The product is rounded once, to x's dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _head_transform_kernel(
    X, Mats, HeadMap, num_tokens, stride_xt, stride_xh, stride_mm,
    D: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr,
):
    tb = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    mask = offs_t[:, None] < num_tokens
    ptrs = X + offs_t[:, None] * stride_xt + h * stride_xh + offs_d[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    m_idx = tl.load(HeadMap + h).to(tl.int64)
    m = tl.load(Mats + m_idx * stride_mm + offs_d[:, None] * D + offs_d[None, :])
    if IEEE:  # fp32 inputs: full fp32 products, not TF32's 10-bit mantissa
        y = tl.dot(x.to(m.dtype), m, input_precision="ieee", out_dtype=tl.float32)
    else:
        y = tl.dot(x.to(m.dtype), m, out_dtype=tl.float32)
    tl.store(ptrs, y.to(X.dtype.element_ty), mask=mask)


def head_transform_(x: torch.Tensor, mats: torch.Tensor, head_map: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (last dim contiguous, any token/head strides) transformed in place; mats [M, D, D]
    contiguous in x's dtype; head_map [H] int32 indices into mats. Returns x."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"head_transform_: expected [T, H, D] contiguous in the last dim, got {tuple(x.shape)}")
    t, h, d = x.shape
    if mats.dim() != 3 or mats.shape[1:] != (d, d) or not mats.is_contiguous() or mats.dtype != x.dtype:
        raise ValueError(f"head_transform_: mats must be [M, {d}, {d}] contiguous {x.dtype}, got "
                         f"{tuple(mats.shape)} {mats.dtype}")
    if head_map.shape != (h,):
        raise ValueError(f"head_transform_: head_map must hold {h} indices, got {tuple(head_map.shape)}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_transform_: head_dim must be a power of 2 >= 16, got {d}")
    if t == 0:
        return x
    block_t = 16 if t <= 16 else 64
    _head_transform_kernel[(triton.cdiv(t, block_t), h)](
        x, mats, head_map, t, x.stride(0), x.stride(1), mats.stride(0), D=d, BLOCK_T=block_t,
        IEEE=x.dtype == torch.float32, num_warps=4 if d <= 64 else 8)
    return x
