"""RotaryKVStore: the decode step's rotary embedding and KV-cache store in one launch.

q is rotated in place (attention reads it next); k is rotated in registers and written straight into its
slot of the paged K buffer, v copied into the V buffer, both from their (strided) views of the fused qkv
projection. Unfused this is three launches per layer: the in-place rotary of q and k, v.contiguous()
(v is a strided slice of qkv) and store_kv. The arithmetic is the same as that sequence: k is rounded to
its own dtype after the rotation (as the in-place kernel stores it) before it is stored or, for an FP8
pool, multiplied by 1 / scale and saturated to +-448 (as store_kv does), so the pool holds bit-for-bit
what the unfused path writes.

Programs: (token, part) with part 0 = q, 1 = k, 2 = v, so the three pieces of one token run side by side
(at batch 1 a single program per token would serialise them)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enabled
from kernels.rotary import _heads_view, rotate_pair


@triton.jit
def _pair_ptrs(base, offs_d, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    if IS_NEOX:
        p1 = base + offs_d[None, :]
        p2 = base + HALF + offs_d[None, :]
    else:
        p1 = base + 2 * offs_d[None, :]
        p2 = base + 2 * offs_d[None, :] + 1
    return p1, p2


@triton.jit
def _quantize(x, inv_scale, QUANT: tl.constexpr):
    y = x
    if QUANT:
        y = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0)
    return y


@triton.jit
def _store_v(V, V_Buffer, token, slot, stride_vt, stride_vh, stride_vbs, stride_vbh, inv_v_scale,
             NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
             QUANT: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_HKV)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    v = tl.load(V + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    v = _quantize(v, inv_v_scale, QUANT)
    tl.store(V_Buffer + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :],
             v.to(V_Buffer.dtype.element_ty), mask=mask)


@triton.jit
def _cos_sin(Positions, Cos_Sin, token, stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pos = tl.load(Positions + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(Cos_Sin + pos * stride_cs + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Cos_Sin + pos * stride_cs + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    return offs_d, mask_d, cos, sin


@triton.jit
def _rotate_q(Positions, Q, Cos_Sin, token, stride_qt, stride_qh, stride_cs, NUM_Q_HEADS: tl.constexpr,
              HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    offs_d, mask_d, cos, sin = _cos_sin(Positions, Cos_Sin, token, stride_cs, HALF, BLOCK_HALF)
    offs_h = tl.arange(0, BLOCK_HQ)
    mask = (offs_h[:, None] < NUM_Q_HEADS) & mask_d[None, :]
    p1, p2 = _pair_ptrs(Q + token * stride_qt + offs_h[:, None] * stride_qh, offs_d, HALF, IS_NEOX)
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate_pair(x1, x2, cos, sin)
    tl.store(p1, o1.to(Q.dtype.element_ty), mask=mask)
    tl.store(p2, o2.to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_store_k(Positions, K, Cos_Sin, K_Buffer, token, slot, stride_kt, stride_kh, stride_cs, stride_kbs,
                    stride_kbh, inv_k_scale, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr, QUANT: tl.constexpr):
    offs_d, mask_d, cos, sin = _cos_sin(Positions, Cos_Sin, token, stride_cs, HALF, BLOCK_HALF)
    offs_h = tl.arange(0, BLOCK_HKV)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & mask_d[None, :]
    p1, p2 = _pair_ptrs(K + token * stride_kt + offs_h[:, None] * stride_kh, offs_d, HALF, IS_NEOX)
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate_pair(x1, x2, cos, sin)
    # Rounded to k's dtype first: what the in-place rotary leaves in k and store_kv then reads.
    o1 = _quantize(o1.to(K.dtype.element_ty), inv_k_scale, QUANT)
    o2 = _quantize(o2.to(K.dtype.element_ty), inv_k_scale, QUANT)
    d1, d2 = _pair_ptrs(K_Buffer + slot * stride_kbs + offs_h[:, None] * stride_kbh, offs_d, HALF, IS_NEOX)
    tl.store(d1, o1.to(K_Buffer.dtype.element_ty), mask=mask)
    tl.store(d2, o2.to(K_Buffer.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kv_store_kernel(
    Positions, Q, K, V, Cos_Sin, K_Buffer, V_Buffer, Loc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, inv_k_scale, inv_v_scale,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_NEOX: tl.constexpr, QUANT: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Each part in a function of its own: a runtime branch may not bind one name to blocks of two shapes.
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    slot = tl.load(Loc + token).to(tl.int64)
    if part == 0:
        _rotate_q(Positions, Q, Cos_Sin, token, stride_qt, stride_qh, stride_cs, NUM_Q_HEADS, HALF, BLOCK_HQ,
                  BLOCK_HALF, IS_NEOX)
    elif part == 1:
        _rotate_store_k(Positions, K, Cos_Sin, K_Buffer, token, slot, stride_kt, stride_kh, stride_cs, stride_kbs,
                        stride_kbh, inv_k_scale, NUM_KV_HEADS, HALF, BLOCK_HKV, BLOCK_HALF, IS_NEOX, QUANT)
    else:
        _store_v(V, V_Buffer, token, slot, stride_vt, stride_vh, stride_vbs, stride_vbh, inv_v_scale,
                 NUM_KV_HEADS, HEAD_DIM, BLOCK_HKV, BLOCK_D, QUANT)


def rotary_kv_store(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k_scale: float = 1.0,
    v_scale: float = 1.0, is_neox: bool = True,
) -> None:
    """Rotates q [T, Hq*D | Hq, D] in place by positions[t]; writes rotate(k[t]) into k_buffer[loc[t]] and
    v[t] into v_buffer[loc[t]] (k itself is left as it was). FP8 buffers get x / scale saturated to +-448.
    cos_sin_cache [max_pos, D] holds cat(cos, sin) of D // 2 frequencies (full-width rotary only)."""
    _, num_kv_heads, head_dim = k_buffer.shape
    if cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"rotary_kv_store rotates whole heads: cos_sin_cache width {cos_sin_cache.shape[-1]} "
                         f"!= head_dim {head_dim}")
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    q3, k3, v3 = _heads_view(q, head_dim), _heads_view(k, head_dim), _heads_view(v, head_dim)
    if q3.shape[0] != num_tokens or k3.shape != (num_tokens, num_kv_heads, head_dim) or v3.shape != k3.shape \
            or loc.shape[0] != num_tokens:
        raise ValueError(f"positions {num_tokens} tokens, q {tuple(q3.shape)}, k {tuple(k3.shape)}, v "
                         f"{tuple(v3.shape)}, loc {tuple(loc.shape)} do not match buffers [*, {num_kv_heads}, "
                         f"{head_dim}]")
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("k_buffer and v_buffer must be contiguous in their last dimension")
    half = head_dim // 2
    pdl = pdl_enabled(q3)
    _rotary_kv_store_kernel[(num_tokens, 3)](
        positions, q3, k3, v3, cos_sin_cache, k_buffer, v_buffer, loc,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1), cos_sin_cache.stride(0),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        1.0 / k_scale, 1.0 / v_scale,
        NUM_Q_HEADS=q3.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_HQ=triton.next_power_of_2(q3.shape[1]), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(head_dim),
        IS_NEOX=is_neox, QUANT=k_buffer.element_size() == 1, USE_PDL=pdl, **launch_options(pdl),
    )


def rotary_kv_store_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k_scale: float = 1.0,
    v_scale: float = 1.0, is_neox: bool = True,
) -> None:
    """The unfused sequence it replaces: in-place rotary of q and a copy of k, then store_kv's reference."""
    from kernels.kv_store import store_kv_ref
    from kernels.rotary import apply_rotary_ref

    head_dim = k_buffer.shape[-1]
    k_rot = k.clone()
    apply_rotary_ref(positions, q, k_rot, cos_sin_cache, head_dim, is_neox=is_neox)
    store_kv_ref(k_buffer, v_buffer, loc, k_rot.reshape(-1, k_buffer.shape[1], head_dim),
                 v.reshape(-1, v_buffer.shape[1], head_dim), k_scale, v_scale)
