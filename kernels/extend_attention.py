"""Extend (prefill) attention: the new tokens of each request attend to its cached prefix (full) and to the
new tokens themselves (causal), all requests packed back to back in one ragged batch.

The prefix K/V is gathered from the paged buffers through req_to_token; the new K/V is read from the
projection outputs directly (it is also already in the buffers, but reading it contiguously is cheaper
than the indirect gather). Online softmax over both parts, fp32 accumulators. With a sliding window W a
token at position p sees keys at positions p - W + 1 .. p (as HF's sliding-window mask); blocks wholly
before that are skipped. FP8 KV buffers (float8_e4m3fn, one static scale each for K and V) are widened
to q's dtype as the prefix is read: the K scale joins the softmax scale of the prefix part, V tiles are
scaled as they load. The new tokens' k/v are used as given (an FP8 caller passes them dequantized
from the pool, so they match what every later read of the pool returns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(qk, v, acc, l_i, m_i):
    """Folds one key block (scores qk in log2 units, values v) into the running softmax: rows that have
    seen no visible key yet (max -inf) keep a zero accumulator instead of NaN."""
    new_m = tl.maximum(m_i, tl.max(qk, 1))
    safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
    rescale = tl.exp2(m_i - safe_m)
    p = tl.exp2(qk - safe_m[:, None])
    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
    l_i = l_i * rescale + tl.sum(p, 1)
    return acc, l_i, new_m


@triton.jit
def _extend_kernel(
    Q,
    K_Extend,
    V_Extend,
    Out,
    K_Buffer,
    V_Buffer,
    Req_To_Token,
    Req_Pool_Indices,
    Seq_Lens,
    Prefix_Lens,
    Extend_Start_Loc,
    qk_scale,
    prefix_qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_req,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    block_m = tl.program_id(2)
    cur_kv_head = cur_head // KV_GROUP

    seq_len = tl.load(Seq_Lens + cur_batch).to(tl.int32)
    prefix_len = tl.load(Prefix_Lens + cur_batch).to(tl.int32)
    extend_len = seq_len - prefix_len
    token_start = tl.load(Extend_Start_Loc + cur_batch).to(tl.int64)
    req_row = tl.load(Req_Pool_Indices + cur_batch).to(tl.int64)

    # The grid is sized for the longest request; blocks past this request's new tokens have no work.
    if block_m * BLOCK_M < extend_len:
        offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < extend_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            Q + (token_start + offs_m)[:, None] * stride_qt + cur_head * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Part 1: the cached prefix, visible in full to every new token (within the window, if any).
        lo = prefix_len * 0
        if WINDOW > 0:
            lo = tl.maximum(prefix_len + block_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        for start_n in range(lo, prefix_len, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix_len
            kv_loc = tl.load(Req_To_Token + req_row * stride_req + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(
                K_Buffer + kv_loc[None, :] * stride_kbs + cur_kv_head * stride_kbh + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )
            if KV_FP8:
                k = k.to(q.dtype)
            qk = tl.dot(q, k) * prefix_qk_scale
            visible = mask_n[None, :]
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > (prefix_len + offs_m)[:, None] - WINDOW)
            qk = tl.where(visible, qk, float("-inf"))
            v = tl.load(
                V_Buffer + kv_loc[:, None] * stride_vbs + cur_kv_head * stride_vbh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            if KV_FP8:
                v = (v.to(tl.float32) * v_scale).to(q.dtype)
            acc, l_i, m_i = _online_softmax_step(qk, v, acc, l_i, m_i)

        # Part 2: the new tokens, causal; keys past this query block's last row are never visible.
        end_n = tl.minimum(extend_len, (block_m + 1) * BLOCK_M)
        lo = extend_len * 0
        if WINDOW > 0:
            lo = tl.maximum(block_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        for start_n in range(lo, end_n, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < extend_len
            k = tl.load(
                K_Extend + (token_start + offs_n)[None, :] * stride_kt + cur_kv_head * stride_kh + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )
            qk = tl.dot(q, k) * qk_scale
            visible = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > offs_m[:, None] - WINDOW)
            qk = tl.where(visible, qk, float("-inf"))
            v = tl.load(
                V_Extend + (token_start + offs_n)[:, None] * stride_vt + cur_kv_head * stride_vh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            acc, l_i, m_i = _online_softmax_step(qk, v, acc, l_i, m_i)

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            Out + (token_start + offs_m)[:, None] * stride_ot + cur_head * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def extend_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    sliding_window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes into `o` [T, Hq, D]. FP8 buffers are read as stored * scale. q/k/v [T, H*, D] hold request b's new tokens at rows
    extend_start_loc[b] .. + seq_lens[b] - prefix_lens[b]; `max_extend_len` (a host int) sizes the grid."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0 or max_extend_len <= 0:
        return

    kv_fp8 = k_buffer.element_size() == 1
    block_d = triton.next_power_of_2(head_dim)
    if block_d <= 128:
        block_m, block_n, num_warps = 64, 64, 4
    else:
        block_m, block_n, num_warps = 32, 32, 8
    grid = (batch, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k, v, o, k_buffer, v_buffer,
        req_to_token, req_pool_indices, seq_lens, prefix_lens, extend_start_loc,
        sm_scale * _LOG2E,
        sm_scale * _LOG2E * (k_scale if kv_fp8 else 1.0),
        v_scale,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        o.stride(0), o.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        KV_GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        WINDOW=max(sliding_window, 0),
        KV_FP8=kv_fp8,
        num_warps=num_warps,
        num_stages=1,
    )


def extend_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    sm_scale: float,
    sliding_window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """FP8 buffers are read as stored * scale. Per request: keys = cached prefix (from the buffers) + new tokens (from k/v), causal over the new
    part (and within the last sliding_window positions when > 0), softmax in fp32. Returns o [T, Hq, D]
    in q's dtype."""
    num_heads = q.shape[1]
    kv_group = num_heads // k.shape[1]
    o = torch.zeros_like(q)
    for b in range(seq_lens.shape[0]):
        prefix, total = int(prefix_lens[b]), int(seq_lens[b])
        start, n_new = int(extend_start_loc[b]), total - prefix
        if n_new <= 0:
            continue
        slots = req_to_token[int(req_pool_indices[b]), :prefix].long()
        fp8 = k_buffer.element_size() == 1
        k_pre = k_buffer[slots].float() * (k_scale if fp8 else 1.0)
        v_pre = v_buffer[slots].float() * (v_scale if fp8 else 1.0)
        keys = torch.cat([k_pre, k[start:start + n_new].float()]).repeat_interleave(kv_group, dim=1)
        vals = torch.cat([v_pre, v[start:start + n_new].float()]).repeat_interleave(kv_group, dim=1)
        scores = torch.einsum("mhd,nhd->hmn", q[start:start + n_new].float(), keys) * sm_scale
        # New token i sits at position prefix + i and sees keys 0 .. prefix + i.
        pos_q = (prefix + torch.arange(n_new))[:, None]
        visible = torch.arange(total)[None, :] <= pos_q
        if sliding_window > 0:
            visible &= torch.arange(total)[None, :] > pos_q - sliding_window
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        o[start:start + n_new] = torch.einsum("hmn,nhd->mhd", scores.softmax(dim=-1), vals).to(q.dtype)
    return o
