"""Verify attention: a few new query tokens per request (a TARGET_VERIFY step: the last token + K drafts)
over the request's paged KV, flash-decoding style.

The extend kernel would give each (request, query head) one program with a 64-row query tile of which
K + 1 rows are real, and re-read the prefix once per query head. Here, as in decode_attention, one
program serves every query head of a KV head *and* every new token of the request (rows = token x head),
so each K/V row is read once per KV head, and the sequence is split into `num_kv_splits` chunks so a
batch of one still fills the GPU. New token j of a request with prefix P sees keys 0 .. P + j (causal
among the new tokens); its K/V must already be in the buffers (the backend stores before attending), so
every key is gathered through req_to_token. Stage 2 merges each row's chunks by their log-sum-exps.
Every launch size is known on the host, so the call is captured in CUDA graphs as is. With a sliding
window W, token j sees only keys P + j - W + 1 .. P + j. FP8 buffers (float8_e4m3fn, static scales) are
widened tile by tile; the K scale joins the softmax scale and the V scale each chunk's output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MIN_BLOCK_KV = 32  # chunks are rounded up to this many tokens
_MIN_BLOCK_R = 16  # tl.dot needs at least 16 rows
MAX_ROWS = 64  # token x head rows per program; more heads per KV head are split over several programs
_LOG2E = 1.4426950408889634
# The per-request index tensors are slices of one packed host->device copy whose offsets follow the
# step's token count, so their 16-byte alignment changes from step to step; Triton would compile a
# variant per alignment pattern (seconds each, in the middle of serving). They are read once per
# program, so alignment buys nothing: one compile covers every step, captured or eager.
_UNALIGNED = ("Req_Pool_Indices", "Seq_Lens", "Prefix_Lens", "Extend_Start_Loc")


@triton.jit(do_not_specialize=_UNALIGNED)
def _verify_stage1_kernel(
    Q,
    K_Buffer,
    V_Buffer,
    Req_To_Token,
    Req_Pool_Indices,
    Seq_Lens,
    Prefix_Lens,
    Extend_Start_Loc,
    Mid,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_kbs,
    stride_kh,
    stride_vbs,
    stride_vh,
    stride_req,
    stride_mid_t,
    stride_mid_h,
    stride_mid_s,
    KV_GROUP: tl.constexpr,
    HEADS_PER_BLOCK: tl.constexpr,
    BLOCKS_PER_GROUP: tl.constexpr,
    MAX_Q: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_BLOCK_KV: tl.constexpr,
    WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    head_block = tl.program_id(1)
    split_id = tl.program_id(2)

    cur_kv_head = head_block // BLOCKS_PER_GROUP
    first_head = cur_kv_head * KV_GROUP + (head_block % BLOCKS_PER_GROUP) * HEADS_PER_BLOCK
    offs_r = tl.arange(0, BLOCK_R)
    tok = offs_r // HEADS_PER_BLOCK  # the row's new token within the request
    head = first_head + offs_r % HEADS_PER_BLOCK

    seq_len = tl.load(Seq_Lens + cur_batch).to(tl.int32)
    prefix_len = tl.load(Prefix_Lens + cur_batch).to(tl.int32)
    token_start = tl.load(Extend_Start_Loc + cur_batch).to(tl.int64)
    req_row = tl.load(Req_Pool_Indices + cur_batch).to(tl.int64)
    mask_r = (tok < MAX_Q) & (tok < seq_len - prefix_len) & (head < (cur_kv_head + 1) * KV_GROUP)
    limit = prefix_len + tok + 1  # the row sees keys [limit - WINDOW, limit)

    kv_start = seq_len * 0
    if WINDOW > 0:
        kv_start = tl.maximum(prefix_len + 1 - WINDOW, 0)
    kv_per_split = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), MIN_BLOCK_KV) * MIN_BLOCK_KV
    split_start = kv_start + kv_per_split * split_id
    split_end = tl.minimum(split_start + kv_per_split, seq_len)

    if split_end > split_start:
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            Q + (token_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=mask_r[:, None] & mask_d[None, :],
            other=0.0,
        )
        e_max = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        e_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < split_end
            kv_loc = tl.load(Req_To_Token + req_row * stride_req + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(
                K_Buffer + kv_loc[None, :] * stride_kbs + cur_kv_head * stride_kh + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )
            if KV_FP8:
                k = k.to(q.dtype)
            qk = tl.dot(q, k) * qk_scale  # log2 domain: the scale includes log2(e)
            visible = mask_r[:, None] & mask_n[None, :] & (offs_n[None, :] < limit[:, None])
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] >= limit[:, None] - WINDOW)
            qk = tl.where(visible, qk, float("-inf"))
            v = tl.load(
                V_Buffer + kv_loc[:, None] * stride_vbs + cur_kv_head * stride_vh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            if KV_FP8:
                v = v.to(q.dtype)
            new_max = tl.maximum(tl.max(qk, 1), e_max)
            # Rows with no visible key yet stay at -inf; a finite stand-in keeps them at 0 instead of NaN.
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp2(e_max - safe_max)
            p = tl.exp2(qk - safe_max[:, None])
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
            e_sum = e_sum * rescale + tl.sum(p, 1)
            e_max = new_max

        safe_sum = tl.where(e_sum > 0, e_sum, 1.0)
        mid_offs = (token_start + tok) * stride_mid_t + head * stride_mid_h + split_id * stride_mid_s
        tl.store(Mid + mid_offs[:, None] + offs_d[None, :], acc / safe_sum[:, None] * v_scale,
                 mask=mask_r[:, None] & mask_d[None, :])
        tl.store(Mid + mid_offs + HEAD_DIM, e_max + tl.log2(safe_sum), mask=mask_r)


@triton.jit(do_not_specialize=_UNALIGNED[1:])
def _verify_stage2_kernel(
    Mid,
    Out,
    Seq_Lens,
    Prefix_Lens,
    Extend_Start_Loc,
    stride_mid_t,
    stride_mid_h,
    stride_mid_s,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MIN_BLOCK_KV: tl.constexpr,
    WINDOW: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    tok = tl.program_id(2)
    seq_len = tl.load(Seq_Lens + cur_batch).to(tl.int32)
    prefix_len = tl.load(Prefix_Lens + cur_batch).to(tl.int32)
    if tok < seq_len - prefix_len:
        token = tl.load(Extend_Start_Loc + cur_batch).to(tl.int64) + tok
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        kv_start = seq_len * 0
        if WINDOW > 0:
            kv_start = tl.maximum(prefix_len + 1 - WINDOW, 0)
        kv_per_split = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), MIN_BLOCK_KV) * MIN_BLOCK_KV
        e_max = float("-inf")
        e_sum = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        base = token * stride_mid_t + cur_head * stride_mid_h
        for split_id in range(0, NUM_SPLITS):
            split_start = kv_start + kv_per_split * split_id
            split_end = tl.minimum(split_start + kv_per_split, seq_len)
            if split_end > split_start:  # chunks past the end were never written
                lse = tl.load(Mid + base + split_id * stride_mid_s + HEAD_DIM)
                # A chunk wholly after this row's causal limit (or before its window) holds no keys for it.
                if lse > float("-inf"):
                    part = tl.load(Mid + base + split_id * stride_mid_s + offs_d, mask=mask_d, other=0.0)
                    new_max = tl.maximum(lse, e_max)
                    old_scale = tl.exp2(e_max - new_max)
                    weight = tl.exp2(lse - new_max)
                    acc = acc * old_scale + part * weight
                    e_sum = e_sum * old_scale + weight
                    e_max = new_max
        out = acc / tl.where(e_sum > 0, e_sum, 1.0)
        tl.store(Out + token * stride_ot + cur_head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def verify_attention_workspace(num_tokens: int, num_heads: int, head_dim: int, num_kv_splits: int,
                               device: torch.device | str) -> torch.Tensor:
    """The stage-1 scratch buffer: per (new token, head, split) the partial output and, last, its lse."""
    return torch.empty((num_tokens, num_heads, num_kv_splits, head_dim + 1), dtype=torch.float32, device=device)


def verify_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    num_kv_splits: int = 8,
    workspace: torch.Tensor | None = None,
    sliding_window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes into `o` [T, Hq, D] the attention of q [T, Hq, D]: request b's new tokens are rows
    extend_start_loc[b] .. + seq_lens[b] - prefix_lens[b], at most `max_extend_len` (a host int) each, and
    their K/V are already stored in the buffers. `workspace`: an optional [>=T, Hq, num_kv_splits, D+1]
    fp32 buffer (pass a fixed one when capturing CUDA graphs)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not 0 < max_extend_len <= MAX_ROWS:
        if max_extend_len <= 0:
            return
        raise ValueError(f"verify attention takes at most {MAX_ROWS} new tokens per request, got {max_extend_len}")
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return
    if workspace is None:
        workspace = verify_attention_workspace(num_tokens, num_heads, head_dim, num_kv_splits, q.device)
    elif workspace.shape[1:] != (num_heads, num_kv_splits, head_dim + 1) or workspace.shape[0] < num_tokens:
        raise ValueError(f"workspace has shape {tuple(workspace.shape)}, needs [>={num_tokens}, {num_heads}, "
                         f"{num_kv_splits}, {head_dim + 1}]")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")

    kv_group = num_heads // num_kv_heads
    heads_per_block = min(kv_group, max(1, MAX_ROWS // max_extend_len))
    blocks_per_group = triton.cdiv(kv_group, heads_per_block)
    block_r = max(_MIN_BLOCK_R, triton.next_power_of_2(heads_per_block * max_extend_len))
    block_d = triton.next_power_of_2(head_dim)
    kv_fp8 = k_buffer.element_size() == 1
    window = max(sliding_window, 0)
    _verify_stage1_kernel[(batch, num_kv_heads * blocks_per_group, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, prefix_lens, extend_start_loc, workspace,
        sm_scale * _LOG2E * (k_scale if kv_fp8 else 1.0),
        v_scale if kv_fp8 else 1.0,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        workspace.stride(0), workspace.stride(1), workspace.stride(2),
        KV_GROUP=kv_group,
        HEADS_PER_BLOCK=heads_per_block,
        BLOCKS_PER_GROUP=blocks_per_group,
        MAX_Q=max_extend_len,
        NUM_SPLITS=num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_R=block_r,
        BLOCK_N=32 if block_d > 128 or block_r > 32 else 64,
        MIN_BLOCK_KV=_MIN_BLOCK_KV,
        WINDOW=window,
        KV_FP8=kv_fp8,
        num_warps=4,
        num_stages=2,
    )
    _verify_stage2_kernel[(batch, num_heads, max_extend_len)](
        workspace, o, seq_lens, prefix_lens, extend_start_loc,
        workspace.stride(0), workspace.stride(1), workspace.stride(2),
        o.stride(0), o.stride(1),
        NUM_SPLITS=num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        MIN_BLOCK_KV=_MIN_BLOCK_KV,
        WINDOW=window,
        num_warps=4,
    )
