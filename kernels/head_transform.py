"""Per-head D x D transform in place: x[t, h, :] = x[t, h, :] @ mats[head_map[h]], one launch for every head
of a [T, H, D] strided view (the FP8 KV rotation's q, k and v in one go: they are adjacent heads of the
fused qkv projection's output, each with its own matrix).

One program per (block of BLOCK_T tokens, head): the [BLOCK_T, D] tile and its D x D matrix go through
tl.dot with fp32 accumulation, and the result is stored back over the tile it was read from (no other
program touches that tile, so in place is safe). The product is rounded once, to x's dtype. The tile is
read as its two halves (x1 @ M[:D/2] + x2 @ M[D/2:], accumulated in that order) because that is how the
fused rotary + transform + KV store (kernels/rotary_transform_kv_store.py) sees a head after the neox
rotary: both go through transform_halves, so they compute the same bits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def transform_halves(x1, x2, Mats, m_idx, stride_mm, D: tl.constexpr, IEEE: tl.constexpr):
    """[BT, D/2] halves of a head's rows times its D x D matrix → [BT, D] fp32."""
    HALF: tl.constexpr = D // 2
    offs_h = tl.arange(0, HALF)
    offs_d = tl.arange(0, D)
    base = Mats + m_idx * stride_mm
    m1 = tl.load(base + offs_h[:, None] * D + offs_d[None, :])
    m2 = tl.load(base + (HALF + offs_h)[:, None] * D + offs_d[None, :])
    if IEEE:  # fp32 inputs: full fp32 products, not TF32's 10-bit mantissa
        y = tl.dot(x1.to(m1.dtype), m1, input_precision="ieee", out_dtype=tl.float32)
        y = tl.dot(x2.to(m2.dtype), m2, acc=y, input_precision="ieee", out_dtype=tl.float32)
    else:
        y = tl.dot(x1.to(m1.dtype), m1, out_dtype=tl.float32)
        y = tl.dot(x2.to(m2.dtype), m2, acc=y, out_dtype=tl.float32)
    return y


# num_tokens changes every step: unspecialized, one compile serves every count (not one more for 1
# and for multiples of 16).
@triton.jit(do_not_specialize=("num_tokens",))
def _head_transform_kernel(
    X, Mats, HeadMap, num_tokens, stride_xt, stride_xh, stride_mm,
    D: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    tb = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, HALF)
    mask = offs_t[:, None] < num_tokens
    row = X + offs_t[:, None] * stride_xt + h * stride_xh
    x1 = tl.load(row + offs_h[None, :], mask=mask, other=0.0)
    x2 = tl.load(row + HALF + offs_h[None, :], mask=mask, other=0.0)
    m_idx = tl.load(HeadMap + h).to(tl.int64)
    y = transform_halves(x1, x2, Mats, m_idx, stride_mm, D, IEEE)
    tl.store(row + tl.arange(0, D)[None, :], y.to(X.dtype.element_ty), mask=mask)


def check_transform_args(x: torch.Tensor, mats: torch.Tensor, head_map: torch.Tensor) -> None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"head transform: expected [T, H, D] contiguous in the last dim, got {tuple(x.shape)}")
    _, h, d = x.shape
    if mats.dim() != 3 or mats.shape[1:] != (d, d) or not mats.is_contiguous() or mats.dtype != x.dtype:
        raise ValueError(f"head transform: mats must be [M, {d}, {d}] contiguous {x.dtype}, got "
                         f"{tuple(mats.shape)} {mats.dtype}")
    if head_map.shape != (h,):
        raise ValueError(f"head transform: head_map must hold {h} indices, got {tuple(head_map.shape)}")
    if d < 32 or d & (d - 1):
        raise ValueError(f"head transform: head_dim must be a power of 2 >= 32, got {d}")


def transform_launch_config(num_tokens: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_T, num_warps), shared with the fused rotary + transform + store so both tile alike."""
    return (16 if num_tokens <= 16 else 64), (4 if head_dim <= 64 else 8)


def head_transform_(x: torch.Tensor, mats: torch.Tensor, head_map: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (last dim contiguous, any token/head strides) transformed in place; mats [M, D, D]
    contiguous in x's dtype; head_map [H] int32 indices into mats. Returns x."""
    check_transform_args(x, mats, head_map)
    t, h, d = x.shape
    if t == 0:
        return x
    block_t, warps = transform_launch_config(t, d)
    _head_transform_kernel[(triton.cdiv(t, block_t), h)](
        x, mats, head_map, t, x.stride(0), x.stride(1), mats.stride(0), D=d, BLOCK_T=block_t,
        IEEE=x.dtype == torch.float32, num_warps=warps)
    return x
