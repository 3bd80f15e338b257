"""The decode step's rotary, FP8 KV rotation and KV-cache store in one launch (rotated FP8 pools; the
unrotated path is kernels/rotary_kv_store.py).

qkv is the fused projection's output viewed as [T, Hq + 2 Hkv, D]. Per (block of tokens, head): q and k
heads get the neox rotary (kernels/rotary.rotate_pair, rounded to qkv's dtype as the in-place rotary
stores it), then every head is multiplied by its D x D matrix (kernels/head_transform.transform_halves,
rounded to qkv's dtype); q heads are written back in place, k and v heads go to their slots of the paged
buffers, times 1 / scale and saturated to +-448 for FP8 (as store_kv does). Unfused that is three launches
per layer: the rotary, head_transform_ and the backend's store_kv, which compute the same bits.

V_AS_IS (V's rotation folded into W_v / W_o, runtime/model_executor/v_rotation_fold.py): v heads go to the pool
as they are, with no identity product. rotary_transform_ is the same kernel with no store: every head it is
given is written back in place (EXTEND where the backend reads the new tokens' K/V as computed, e.g.
flashinfer's ragged prefill): the bits of the rotary followed by head_transform_."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.head_transform import check_transform_args, transform_halves, transform_launch_config
from kernels.rotary import rotate_pair


@triton.jit
def _store_half(dst, x, inv_scale, mask, QUANT: tl.constexpr):
    """x at dst, times inv_scale and saturated to +-448 for FP8 (as store_kv does)."""
    val = x
    if QUANT:
        val = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0)
    tl.store(dst, val.to(dst.dtype.element_ty), mask=mask)


# num_tokens changes every step: unspecialized, one compile serves every count (not one more for 1
# and for multiples of 16).
@triton.jit(do_not_specialize=("num_tokens",))
def _rotary_transform_kv_store_kernel(
    Positions, QKV, Cos_Sin, Mats, HeadMap, K_Buffer, V_Buffer, Loc, num_tokens,
    stride_t, stride_h, stride_cs, stride_mm, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    inv_k_scale, inv_v_scale,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    IEEE: tl.constexpr, QUANT: tl.constexpr, IN_PLACE: tl.constexpr, V_AS_IS: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    tb = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    mask = mask_t[:, None]
    offs_h = tl.arange(0, HALF)
    offs_d = tl.arange(0, D)
    row = QKV + offs_t[:, None] * stride_t + h * stride_h
    x1 = tl.load(row + offs_h[None, :], mask=mask, other=0.0)
    x2 = tl.load(row + HALF + offs_h[None, :], mask=mask, other=0.0)
    if h < NUM_Q_HEADS + NUM_KV_HEADS:  # q and k heads: the rotary first
        pos = tl.load(Positions + offs_t, mask=mask_t, other=0).to(tl.int64)
        cs = Cos_Sin + pos[:, None] * stride_cs + offs_h[None, :]
        cos = tl.load(cs, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(cs + HALF, mask=mask, other=0.0).to(tl.float32)
        o1, o2 = rotate_pair(x1.to(tl.float32), x2.to(tl.float32), cos, sin)
        x1 = o1.to(QKV.dtype.element_ty)
        x2 = o2.to(QKV.dtype.element_ty)
    if V_AS_IS and h >= NUM_Q_HEADS + NUM_KV_HEADS:  # v heads: to the pool as they are
        slot = tl.load(Loc + offs_t, mask=mask_t, other=0).to(tl.int64)
        dst = V_Buffer + slot[:, None] * stride_vbs + (h - NUM_Q_HEADS - NUM_KV_HEADS) * stride_vbh
        _store_half(dst + offs_h[None, :], x1, inv_v_scale, mask, QUANT)
        _store_half(dst + HALF + offs_h[None, :], x2, inv_v_scale, mask, QUANT)
    else:
        m_idx = tl.load(HeadMap + h).to(tl.int64)
        y = transform_halves(x1, x2, Mats, m_idx, stride_mm, D, IEEE).to(QKV.dtype.element_ty)
        if IN_PLACE or h < NUM_Q_HEADS:
            tl.store(row + offs_d[None, :], y, mask=mask)
        else:
            slot = tl.load(Loc + offs_t, mask=mask_t, other=0).to(tl.int64)
            if h < NUM_Q_HEADS + NUM_KV_HEADS:
                dst = K_Buffer + slot[:, None] * stride_kbs + (h - NUM_Q_HEADS) * stride_kbh
                _store_half(dst + offs_d[None, :], y, inv_k_scale, mask, QUANT)
            else:
                dst = V_Buffer + slot[:, None] * stride_vbs + (h - NUM_Q_HEADS - NUM_KV_HEADS) * stride_vbh
                _store_half(dst + offs_d[None, :], y, inv_v_scale, mask, QUANT)


def rotary_transform_kv_store(
    positions: torch.Tensor, qkv: torch.Tensor, cos_sin_cache: torch.Tensor, mats: torch.Tensor,
    head_map: torch.Tensor, num_q_heads: int, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
    loc: torch.Tensor, k_scale: float, v_scale: float, v_as_is: bool = False,
) -> None:
    """qkv [T, Hq + 2 Hkv, D] (neox rotary over all of D; cos_sin_cache [max_pos, D]): q heads rotated and
    transformed in place; k and v heads rotated (k only), transformed (v not, with v_as_is) and stored at
    k/v_buffer[loc]."""
    check_transform_args(qkv, mats, head_map)
    t, h, d = qkv.shape
    hkv = k_buffer.shape[1]
    if h != num_q_heads + 2 * hkv or k_buffer.shape[1:] != (hkv, d) or v_buffer.shape[1:] != (hkv, d):
        raise ValueError(f"qkv {tuple(qkv.shape)} does not match {num_q_heads} q heads and buffers "
                         f"{tuple(k_buffer.shape)} / {tuple(v_buffer.shape)}")
    _check_rows(positions, cos_sin_cache, t, d, loc)
    _launch(positions, qkv, cos_sin_cache, mats, head_map, num_q_heads, hkv, k_buffer, v_buffer, loc,
            1.0 / k_scale, 1.0 / v_scale, in_place=False, v_as_is=v_as_is)


def rotary_transform_(
    positions: torch.Tensor, qkv: torch.Tensor, cos_sin_cache: torch.Tensor, mats: torch.Tensor,
    head_map: torch.Tensor, num_q_heads: int, num_kv_heads: int,
) -> None:
    """qkv [T, Hq + Hkv (+ Hkv), D]: q and k heads rotated (neox) then transformed, v heads (where given)
    transformed, all in place: the bits of the rotary followed by head_transform_, in one launch."""
    check_transform_args(qkv, mats, head_map)
    t, h, d = qkv.shape
    if h not in (num_q_heads + num_kv_heads, num_q_heads + 2 * num_kv_heads):
        raise ValueError(f"qkv {tuple(qkv.shape)} has neither {num_q_heads} q + {num_kv_heads} k heads nor "
                         f"also {num_kv_heads} v heads")
    _check_rows(positions, cos_sin_cache, t, d, None)
    _launch(positions, qkv, cos_sin_cache, mats, head_map, num_q_heads, num_kv_heads, qkv, qkv, positions,
            1.0, 1.0, in_place=True, v_as_is=False)


def _check_rows(positions: torch.Tensor, cos_sin_cache: torch.Tensor, t: int, d: int,
                loc: torch.Tensor | None) -> None:
    if cos_sin_cache.shape[-1] != d or positions.shape[0] != t or (loc is not None and loc.shape[0] != t):
        raise ValueError(f"positions {tuple(positions.shape)}, loc {None if loc is None else tuple(loc.shape)} "
                         f"and cos_sin_cache {tuple(cos_sin_cache.shape)} must match {t} tokens of head_dim {d}")


def _launch(positions: torch.Tensor, qkv: torch.Tensor, cos_sin_cache: torch.Tensor, mats: torch.Tensor,
            head_map: torch.Tensor, hq: int, hkv: int, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
            loc: torch.Tensor, inv_k_scale: float, inv_v_scale: float, in_place: bool, v_as_is: bool) -> None:
    t, h, d = qkv.shape
    if t == 0:
        return
    block_t, warps = transform_launch_config(t, d)
    kb, vb = (k_buffer.stride(0), k_buffer.stride(1)), (v_buffer.stride(0), v_buffer.stride(1))
    _rotary_transform_kv_store_kernel[(triton.cdiv(t, block_t), h)](
        positions, qkv, cos_sin_cache, mats, head_map, k_buffer, v_buffer, loc, t,
        qkv.stride(0), qkv.stride(1), cos_sin_cache.stride(0), mats.stride(0), *kb, *vb, inv_k_scale, inv_v_scale,
        NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, D=d, BLOCK_T=block_t, IEEE=qkv.dtype == torch.float32,
        QUANT=not in_place and k_buffer.element_size() == 1, IN_PLACE=in_place, V_AS_IS=v_as_is, num_warps=warps)
