"""KV store: scatter the new tokens' K and V into their slots of one layer's paged buffers.

FP8 buffers (float8_e4m3fn) store saturate(x / scale) with one static scale for K and one for V; the
decode/extend kernels multiply it back when they read."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K_Buffer,
    V_Buffer,
    Loc,
    K,
    V,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    inv_k_scale,
    inv_v_scale,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # One row of H*D elements is split across programs; the flat index maps back to (head, dim).
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUM_HEADS * HEAD_DIM
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    slot = tl.load(Loc + token).to(tl.int64)
    k = tl.load(K + token * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(V + token * stride_vt + head * stride_vh + dim, mask=mask)
    if QUANT:
        k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_k_scale, -448.0), 448.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_v_scale, -448.0), 448.0)
    tl.store(K_Buffer + slot * stride_kbs + head * stride_kbh + dim, k.to(K_Buffer.dtype.element_ty), mask=mask)
    tl.store(V_Buffer + slot * stride_vbs + head * stride_vbh + dim, v.to(V_Buffer.dtype.element_ty), mask=mask)


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """k_buffer[loc[t]] = k[t], v_buffer[loc[t]] = v[t]; k/v [T, Hkv, D] may be strided views (e.g. of a
    fused qkv projection) as long as the last dimension is contiguous. FP8 buffers get k / k_scale and
    v / v_scale, saturated to +-448; the scales are ignored for other buffer dtypes."""
    num_tokens = loc.shape[0]
    if num_tokens == 0:
        return
    _, num_heads, head_dim = k_buffer.shape
    if k.shape != (num_tokens, num_heads, head_dim) or v.shape != (num_tokens, num_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match "
                         f"[{num_tokens}, {num_heads}, {head_dim}]")
    for name, t in (("k", k), ("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    block = min(1024, triton.next_power_of_2(num_heads * head_dim))
    grid = (num_tokens, triton.cdiv(num_heads * head_dim, block))
    _store_kv_kernel[grid](
        k_buffer, v_buffer, loc, k, v,
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        1.0 / k_scale, 1.0 / v_scale,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK=block,
        QUANT=k_buffer.element_size() == 1,
    )


def store_kv_ref(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    if k_buffer.element_size() == 1:
        k = (k.float() * (1.0 / k_scale)).clamp(-448.0, 448.0)
        v = (v.float() * (1.0 / v_scale)).clamp(-448.0, 448.0)
    k_buffer[loc] = k.to(k_buffer.dtype)
    v_buffer[loc] = v.to(v_buffer.dtype)
