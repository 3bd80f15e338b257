"""Rotary position embedding applied in place to q and k, neox ("rotate_half", HF Llama) or GPT-J
(interleaved pairs) style. Only the first rotary_dim = cos_sin_cache.shape[-1] dims of each head rotate."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    X, row_offset, stride_h, cos, sin,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    base = X + row_offset + offs_h[:, None] * stride_h
    if IS_NEOX:
        ptr1 = base + offs_d[None, :]
        ptr2 = base + HALF + offs_d[None, :]
    else:
        ptr1 = base + 2 * offs_d[None, :]
        ptr2 = base + 2 * offs_d[None, :] + 1
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate_pair(x1, x2, cos, sin)
    tl.store(ptr1, o1.to(X.dtype.element_ty), mask=mask)
    tl.store(ptr2, o2.to(X.dtype.element_ty), mask=mask)


@triton.jit
def rotate_pair(x1, x2, cos, sin):
    """The rotation itself, in fp32; shared with kernels/rotary_kv_store.py and rotary_transform_kv_store.py
    so all round identically. The FMAs are explicit: left to the compiler, `a*b - c*d` fuses whichever
    product the surrounding code's instruction order suggests, and that differed between kernels (on an
    H100 the fused rotary + transform + store and the in-place rotary disagreed in a last bit at 300+
    tokens, 2026-11-28)."""
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)


@triton.jit
def _rotary_kernel(
    Positions, Q, K, Cos_Sin, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(Cos_Sin + pos * stride_cs + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Cos_Sin + pos * stride_cs + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(Q, token * stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF, IS_NEOX)
    _rotate_heads(K, token * stride_kt, stride_kh, cos, sin, NUM_K_HEADS, HALF, BLOCK_HK, BLOCK_HALF, IS_NEOX)


def _heads_view(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[T, H*D] or [T, H, D] → a [T, H, D] view of the same storage (writes must land in x)."""
    view = x.view(x.shape[0], -1, head_dim) if x.dim() == 2 else x
    if view.dim() != 3 or view.shape[-1] != head_dim or view.stride(-1) != 1:
        raise ValueError(f"expected [T, H*{head_dim}] or [T, H, {head_dim}] contiguous in the last dim, "
                         f"got {tuple(x.shape)}")
    return view


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    is_neox: bool = True,
) -> None:
    """Rotates q [T, Hq*D | Hq, D] and k [T, Hkv*D | Hkv, D] in place by the angle of positions[t];
    cos_sin_cache [max_pos, rotary_dim] holds cat(cos, sin) of rotary_dim // 2 frequencies."""
    q3, k3 = _heads_view(q, head_dim), _heads_view(k, head_dim)
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim > head_dim or rotary_dim % 2 != 0:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}")
    num_tokens = positions.shape[0]
    if q3.shape[0] != num_tokens or k3.shape[0] != num_tokens:
        raise ValueError(f"positions has {num_tokens} tokens, q {q3.shape[0]}, k {k3.shape[0]}")
    if num_tokens == 0:
        return
    half = rotary_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q3, k3, cos_sin_cache,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=q3.shape[1],
        NUM_K_HEADS=k3.shape[1],
        HALF=half,
        BLOCK_HQ=triton.next_power_of_2(q3.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k3.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
        IS_NEOX=is_neox,
    )


def apply_rotary_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    is_neox: bool = True,
) -> None:
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, rotary_dim // 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        x3 = x.view(x.shape[0], -1, head_dim)
        rot = x3[..., :rotary_dim].float()
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        x3[..., :rotary_dim] = out.to(x.dtype)
