"""Paged attention from torch ops alone: the CPU backend's extend path, and its decode path when the C
kernel (kernels/cpu_decode_attention) cannot be built.

Extend (n > 1 new tokens of one request) runs torch's flash kernel for CPU: with no cached prefix one
causal call on the new K/V (no mask, so it skips the blocks above the diagonal). Over a cached prefix
it runs two calls whose softmaxes are merged by their log-sum-exp: new queries over the prefix (all
visible, no mask) and over the new keys (causal and aligned at the top-left, which is exactly what
torch's is_causal means). A sliding window needs a real mask: queries go in chunks, each against only
the keys its window can reach, so the mask stays [chunk, window + chunk] however long the prompt. On
other devices (the backend is the GPU backends' reference too) a cached prefix takes the mask path.
K/V read from the pool go through kv_quant.dequantize_kv (FP8 pools: stored * scale)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.mem_cache.kv_quant import dequantize_kv, gather_rows, is_fp8

# Query rows per masked extend call: bounds the mask and the keys gathered per call.
MASK_CHUNK = 512

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] → [1, H, T, D] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def extend_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_buf: torch.Tensor,
                     v_buf: torch.Tensor, slots: torch.Tensor, prefix_len: int, scale: float,
                     window: int = 0, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One request's n new tokens: q [n, Hq, D], k_new/v_new [n, Hkv, D] (already stored in the pool),
    slots [prefix_len + n] int64, the request's KV slots. Returns o [n, Hq, D]."""
    n = q.shape[0]
    if (window and prefix_len + n > window) or (prefix_len and q.device.type != "cpu"):
        return _masked(q, k_buf, v_buf, slots, prefix_len, scale, window, k_scale, v_scale)
    qh = _heads_first(q)
    k_new, v_new = _heads_first(k_new).to(q.dtype), _heads_first(v_new).to(q.dtype)
    if prefix_len == 0:
        o = F.scaled_dot_product_attention(qh, k_new, v_new, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    o_new, lse_new = _flash(qh, k_new, v_new, 0.0, True, scale=scale)
    pre = slots[:prefix_len]
    k_pre = _heads_first(dequantize_kv(gather_rows(k_buf, pre), k_scale, q.dtype))
    v_pre = _heads_first(dequantize_kv(gather_rows(v_buf, pre), v_scale, q.dtype))
    o_pre, lse_pre = _flash(qh, k_pre, v_pre, 0.0, False, scale=scale)
    # Each half is softmax-normalized over its own keys; reweight by each half's share of the total mass.
    m = torch.maximum(lse_pre, lse_new)
    w_pre, w_new = (lse_pre - m).exp_(), (lse_new - m).exp_()
    total = w_pre + w_new
    o = (o_pre.float() * (w_pre / total).unsqueeze(-1)).add_(o_new.float() * (w_new / total).unsqueeze(-1))
    return o.to(q.dtype)[0].transpose(0, 1)


def _masked(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor, prefix_len: int,
            scale: float, window: int, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal (and windowed, when window > 0) attention with an explicit mask, in query chunks."""
    n = q.shape[0]
    out = torch.empty_like(q)
    for s in range(0, n, MASK_CHUNK):
        e = min(n, s + MASK_CHUNK)
        first_q, last_q = prefix_len + s, prefix_len + e - 1  # absolute positions of this chunk's queries
        k0 = max(0, first_q - window + 1) if window else 0  # the earliest key any query of the chunk sees
        sel = slots[k0:last_q + 1]
        pos_q = torch.arange(first_q, last_q + 1, device=q.device)[:, None]
        pos_k = torch.arange(k0, last_q + 1, device=q.device)[None, :]
        mask = pos_k <= pos_q
        if window:
            mask &= pos_k > pos_q - window
        o = F.scaled_dot_product_attention(
            _heads_first(q[s:e]), _heads_first(dequantize_kv(gather_rows(k_buf, sel), k_scale, q.dtype)),
            _heads_first(dequantize_kv(gather_rows(v_buf, sel), v_scale, q.dtype)), attn_mask=mask, scale=scale,
            enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)
    return out


def decode_slots(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, window: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV slots each one-token request reads, padded to the longest: ([B, L] int64 slots, padding
    rows point at slot 0) and the additive mask bias [B, 1, 1, L] (0 or -inf), fp32."""
    lens = seq_lens.to(torch.int64)
    starts = (lens - window).clamp_(min=0) if window else torch.zeros_like(lens)
    width = int((lens - starts).max())
    cols = starts[:, None] + torch.arange(width)[None, :]
    valid = cols < lens[:, None]
    slots = req_to_token[rows[:, None], cols.clamp_(max=req_to_token.shape[1] - 1)].to(torch.int64)
    slots.masked_fill_(~valid, 0)
    bias = torch.zeros(valid.shape, dtype=torch.float32).masked_fill_(~valid, float("-inf"))
    return slots, bias[:, None, None, :]


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                     bias: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Every one-token request at once: q [B, Hq, D], slots/bias from decode_slots → o [B, Hq, D].
    One gather of all requests' K/V (index_select, ~6x faster than advanced indexing on CPU), then the
    query heads of each KV head as a [G, D] @ [D, L] matmul per (request, KV head)."""
    b, hq, d = q.shape
    hkv, length = k_buf.shape[1], slots.shape[1]
    g = hq // hkv
    flat = slots.view(-1)
    k = gather_rows(k_buf, flat).view(b, length, hkv, d).transpose(1, 2).reshape(b * hkv, length, d)
    v = gather_rows(v_buf, flat).view(b, length, hkv, d).transpose(1, 2).reshape(b * hkv, length, d)
    if is_fp8(k_buf.dtype):  # widen once; the K scale joins the softmax scale
        k, v, scale = k.to(q.dtype), dequantize_kv(v, v_scale, q.dtype), scale * k_scale
    scores = torch.baddbmm(bias.expand(b, hkv, g, length).reshape(b * hkv, g, length),
                           q.reshape(b * hkv, g, d).float(), k.transpose(1, 2).float(), alpha=scale)
    probs = scores.softmax(-1).to(v.dtype)
    return torch.bmm(probs, v).view(b, hq, d).to(q.dtype)
