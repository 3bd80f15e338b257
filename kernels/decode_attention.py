"""Decode attention: one new query token per request over its paged KV (page size 1), flash-decoding style.

Stage 1 splits each request's sequence into `num_kv_splits` chunks and computes, per chunk, the softmax-
normalised partial output and its log-sum-exp; one program serves all query heads that share a KV head, so each
K/V row is read once per group. Stage 2 merges the chunks (one chunk in the N-side form: stage 1 writes the
output, no scratch). Every launch size is known on the host, so the call can be captured in a CUDA graph and
replayed with new `seq_lens`/`req_to_token` contents. A sliding window W limits the splits to the last W
tokens. FP8 KV (float8_e4m3fn, a static scale each for K and V) is widened to q's dtype tile by tile, the K
scale folded into the softmax scale and the V scale into each split's output; f16_math widens it to fp16 (one
instruction per pair; bf16 takes several) with q clamped to fp16's range. kv_rows_m puts each K/V tile on the
dots' M side (scores [tokens, heads]), so a widened FP8 tile feeds the MMA from registers; heads_first launches
a request's KV-head programs side by side, so they read each token's row together
(runtime/attention/triton_decode.py says where each pays, and its launch configs).

v_perm (FP8, N side): the P V dot wants two consecutive tokens of one channel in each operand register, and
those sit a pool row apart, so an 8-bit V tile reaches the registers a byte at a time (LDS.U8; 16-bit tiles
use ldmatrix.trans). The dot's output columns can be in any order, though: V's tile is reshaped to
[tokens, D/4, 4] and permuted, so acc column j*D/4 + c holds channel 4c + j and a thread's four columns of one
token are one 32-bit word; the stores un-permute (offs_o). Same arithmetic per channel, so the same bits.

fuse_merge=True does stage 2 inside stage 1 (one launch per layer, kernels/decode_fusion.py): each program
counts itself done on a per-(request, head block) counter, and the last split to finish merges them all with
stage 2's arithmetic (bit-equal output) and resets the counter. Ordering: a CTA barrier, then the counter's
acq_rel atomic (release of every thread's partial, acquire for the merge); the merge reads past L1 (.cg).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enabled

# Chunks are rounded up to this many tokens so short sequences do not get split into tiny pieces.
_MIN_BLOCK_KV = 32
# Query heads one program takes of a KV head's group: tl.dot needs at least 16 rows on tensor cores, so
# smaller GQA groups are padded up to it with masked rows, and larger ones take several programs.
HEAD_BLOCK = 16
_LOG2E = 1.4426950408889634


@triton.jit
def _store_heads(ptr, head_offs, offs_d, val, mask_h, mask_d, D_BY_H: tl.constexpr):
    """val [H, D] ([D, H] when D_BY_H) at ptr + head_offs[h] + d, in ptr's element type."""
    if D_BY_H:
        tl.store(ptr + head_offs[None, :] + offs_d[:, None], val.to(ptr.dtype.element_ty),
                 mask=mask_h[None, :] & mask_d[:, None])
    else:
        tl.store(ptr + head_offs[:, None] + offs_d[None, :], val.to(ptr.dtype.element_ty),
                 mask=mask_h[:, None] & mask_d[None, :])


@triton.jit
def _decode_stage1_kernel(
    Q, K_Buffer, V_Buffer, Req_To_Token, Req_Pool_Indices, Seq_Lens, Mid, Out, Counter, qk_scale, v_scale, stride_qb,
    stride_qh, stride_kbs, stride_kh, stride_vbs, stride_vh, stride_req, stride_mid_b, stride_mid_h, stride_mid_s,
    stride_ob, stride_oh, stride_cnt, KV_GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, VALID_H: tl.constexpr, BLOCKS_PER_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_BLOCK_KV: tl.constexpr, WINDOW: tl.constexpr, KV_FP8: tl.constexpr,
    FUSE_MERGE: tl.constexpr, F16_MATH: tl.constexpr, USE_PDL: tl.constexpr, HEADS_FIRST: tl.constexpr,
    KV_ROWS_M: tl.constexpr, V_PERM: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if HEADS_FIRST:  # a request's KV heads in neighbouring programs: they read one token row together
        head_block = tl.program_id(0)
        cur_batch = tl.program_id(1)
    else:
        cur_batch = tl.program_id(0)
        head_block = tl.program_id(1)
    split_id = tl.program_id(2)
    # One split stores its output itself; not in the M-side form, where that measured 3-7% slower a layer (FP8,
    # 333-400 x 1500-1700, one H100: decode_attention_fp8_direct_*_h100.json).
    DIRECT: tl.constexpr = NUM_SPLITS == 1 and not KV_ROWS_M

    # Each KV head's query group is covered by BLOCKS_PER_GROUP head blocks of VALID_H real heads.
    cur_kv_head = head_block // BLOCKS_PER_GROUP
    first_head = cur_kv_head * KV_GROUP + (head_block % BLOCKS_PER_GROUP) * VALID_H
    offs_h = first_head + tl.arange(0, BLOCK_H)
    mask_h = (tl.arange(0, BLOCK_H) < VALID_H) & (offs_h < (cur_kv_head + 1) * KV_GROUP)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    seq_len = tl.load(Seq_Lens + cur_batch).to(tl.int32)
    req_row = tl.load(Req_Pool_Indices + cur_batch).to(tl.int64)
    kv_start = seq_len * 0
    if WINDOW > 0:
        kv_start = tl.maximum(seq_len - WINDOW, 0)
    kv_per_split = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), MIN_BLOCK_KV) * MIN_BLOCK_KV
    split_start = kv_start + kv_per_split * split_id
    split_end = tl.minimum(split_start + kv_per_split, seq_len)

    if split_end > split_start:
        if KV_ROWS_M:  # K/V tiles as the dot's M side (rows of the pool), q as its N: [BLOCK_N, BLOCK_H] scores
            q = tl.load(Q + cur_batch * stride_qb + offs_h[None, :] * stride_qh + offs_d[:, None],
                        mask=mask_h[None, :] & mask_d[:, None], other=0.0)
        else:
            q = tl.load(Q + cur_batch * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                        mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        if F16_MATH:  # FP8 KV widens to fp16 in one instruction per pair (to bf16 it takes several)
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)  # bf16's range exceeds fp16's
        e_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        e_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        if KV_ROWS_M:
            acc = tl.zeros([BLOCK_D, BLOCK_H], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < split_end
            kv_loc = tl.load(Req_To_Token + req_row * stride_req + offs_n, mask=mask_n, other=0).to(tl.int64)
            if KV_ROWS_M:
                k = tl.load(K_Buffer + kv_loc[:, None] * stride_kbs + cur_kv_head * stride_kh + offs_d[None, :],
                            mask=mask_n[:, None] & mask_d[None, :], other=0.0)
                if KV_FP8:
                    k = k.to(q.dtype)
                # Scores are kept in the log2 domain (scale includes log2(e)) so exp2 can be used throughout.
                qk = tl.dot(k, q) * qk_scale
                qk = tl.where(mask_n[:, None] & mask_h[None, :], qk, float("-inf"))
                v = tl.load(V_Buffer + kv_loc[None, :] * stride_vbs + cur_kv_head * stride_vh + offs_d[:, None],
                            mask=mask_n[None, :] & mask_d[:, None], other=0.0)
                if KV_FP8:
                    v = v.to(q.dtype)
                new_max = tl.maximum(tl.max(qk, 0), e_max)
                safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
                rescale = tl.exp2(e_max - safe_max)
                p = tl.exp2(qk - safe_max[None, :])
                acc = acc * rescale[None, :] + tl.dot(v, p.to(v.dtype))
                e_sum = e_sum * rescale + tl.sum(p, 0)
            else:
                k = tl.load(K_Buffer + kv_loc[None, :] * stride_kbs + cur_kv_head * stride_kh + offs_d[:, None],
                            mask=mask_n[None, :] & mask_d[:, None], other=0.0)
                if KV_FP8:
                    k = k.to(q.dtype)
                qk = tl.dot(q, k) * qk_scale
                qk = tl.where(mask_h[:, None] & mask_n[None, :], qk, float("-inf"))
                v = tl.load(V_Buffer + kv_loc[:, None] * stride_vbs + cur_kv_head * stride_vh + offs_d[None, :],
                            mask=mask_n[:, None] & mask_d[None, :], other=0.0)
                if V_PERM:  # column j * D/4 + c holds channel 4c + j: see the module docstring
                    v = tl.reshape(tl.permute(tl.reshape(v, (BLOCK_N, BLOCK_D // 4, 4)), (0, 2, 1)),
                                   (BLOCK_N, BLOCK_D))
                if KV_FP8:
                    v = v.to(q.dtype)
                new_max = tl.maximum(tl.max(qk, 1), e_max)
                # Padded head rows stay at -inf; subtracting a finite stand-in keeps them at 0 instead of NaN.
                safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
                rescale = tl.exp2(e_max - safe_max)
                p = tl.exp2(qk - safe_max[:, None])
                acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
                e_sum = e_sum * rescale + tl.sum(p, 1)
            e_max = new_max

        safe_sum = tl.where(e_sum > 0, e_sum, 1.0)
        offs_o = offs_d  # the channel each acc column holds
        if V_PERM:
            offs_o = (offs_d % (BLOCK_D // 4)) * 4 + offs_d // (BLOCK_D // 4)
        mask_o = offs_o < HEAD_DIM
        if DIRECT:  # the one partial is the output (a merge scales it by exp2(0) / 1): no scratch
            _store_heads(Out + cur_batch * stride_ob, offs_h * stride_oh, offs_o, acc / safe_sum[:, None] * v_scale,
                         mask_h, mask_o, False)
        else:
            mid_offs = cur_batch * stride_mid_b + offs_h * stride_mid_h + split_id * stride_mid_s
            _store_heads(Mid, mid_offs, offs_o, acc / safe_sum[None, :] * v_scale if KV_ROWS_M
                         else acc / safe_sum[:, None] * v_scale, mask_h, mask_o, KV_ROWS_M)
            tl.store(Mid + mid_offs + HEAD_DIM, e_max + tl.log2(safe_sum), mask=mask_h)
    elif DIRECT:  # a zero-length (padding) request: zeros, as a merge writes
        _store_heads(Out + cur_batch * stride_ob, offs_h * stride_oh, offs_d,
                     tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32), mask_h, mask_d, False)

    if FUSE_MERGE and not DIRECT:
        tl.debug_barrier()  # every thread's partial is written before the release below
        counter = Counter + cur_batch * stride_cnt + head_block
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SPLITS - 1:  # the last split of this (request, head block): merge them all
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # every split has counted: reset
            m_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
            m_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
            m_acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
            base = cur_batch * stride_mid_b + offs_h * stride_mid_h
            mask_hd = mask_h[:, None] & mask_d[None, :]
            for s in range(0, NUM_SPLITS):
                s_start = kv_start + kv_per_split * s
                s_end = tl.minimum(s_start + kv_per_split, seq_len)
                if s_end > s_start:  # as stage 2: splits past a short sequence's end were never written
                    part = tl.load(Mid + base[:, None] + s * stride_mid_s + offs_d[None, :], mask=mask_hd,
                                   other=0.0, cache_modifier=".cg")
                    lse = tl.load(Mid + base + s * stride_mid_s + HEAD_DIM, mask=mask_h, other=0.0,
                                  cache_modifier=".cg")
                    new_max = tl.maximum(lse, m_max)
                    old_scale = tl.exp2(m_max - new_max)
                    weight = tl.exp2(lse - new_max)
                    m_acc = m_acc * old_scale[:, None] + part * weight[:, None]
                    m_sum = m_sum * old_scale + weight
                    m_max = new_max
            out = m_acc / tl.where(m_sum > 0, m_sum, 1.0)[:, None]
            tl.store(Out + cur_batch * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
                     out.to(Out.dtype.element_ty), mask=mask_hd)


@triton.jit
def _decode_stage2_kernel(
    Mid,
    Out,
    Seq_Lens,
    stride_mid_b,
    stride_mid_h,
    stride_mid_s,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MIN_BLOCK_KV: tl.constexpr,
    WINDOW: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    seq_len = tl.load(Seq_Lens + cur_batch).to(tl.int32)
    kv_start = seq_len * 0
    if WINDOW > 0:
        kv_start = tl.maximum(seq_len - WINDOW, 0)
    kv_per_split = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), MIN_BLOCK_KV) * MIN_BLOCK_KV

    e_max = float("-inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = cur_batch * stride_mid_b + cur_head * stride_mid_h
    for split_id in range(0, NUM_SPLITS):
        split_start = kv_start + kv_per_split * split_id
        split_end = tl.minimum(split_start + kv_per_split, seq_len)
        # Splits past the end of a short sequence were never written by stage 1: skip them.
        if split_end > split_start:
            part = tl.load(Mid + base + split_id * stride_mid_s + offs_d, mask=mask_d, other=0.0)
            lse = tl.load(Mid + base + split_id * stride_mid_s + HEAD_DIM)
            new_max = tl.maximum(lse, e_max)
            old_scale = tl.exp2(e_max - new_max)
            weight = tl.exp2(lse - new_max)
            acc = acc * old_scale + part * weight
            e_sum = e_sum * old_scale + weight
            e_max = new_max

    # A zero-length (padding) request yields zeros rather than NaN.
    out = acc / tl.where(e_sum > 0, e_sum, 1.0)
    tl.store(Out + cur_batch * stride_ob + cur_head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def decode_attention_workspace(batch: int, num_heads: int, head_dim: int, num_kv_splits: int,
                               device: torch.device | str) -> torch.Tensor:
    """The stage-1 scratch buffer: per (request, head, split) the partial output and, last, its lse."""
    return torch.empty((batch, num_heads, num_kv_splits, head_dim + 1), dtype=torch.float32, device=device)


def decode_attention_counters(batch: int, num_heads: int, device: torch.device | str) -> torch.Tensor:
    """fuse_merge's per-(request, head block) split counters: zeros, and every launch leaves them zero."""
    return torch.zeros((batch, num_heads), dtype=torch.int32, device=device)


def decode_attention_fwd(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor,
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
    num_kv_splits: int = 8,
    attn_logits: torch.Tensor | None = None,
    sliding_window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fuse_merge: bool = False,
    counters: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    f16_math: bool = False,
    heads_first: bool = False,
    kv_rows_m: bool = False,
    v_perm: bool = False,
) -> None:
    """Writes into `o` [B, Hq, D] the attention of q [B, Hq, D] over each request's first seq_lens[b]
    tokens (only the last `sliding_window` of them when > 0). FP8 buffers are read as stored * scale.
    `attn_logits` is an optional [>=B, Hq, num_kv_splits, D+1] fp32 workspace (pass a fixed one when
    capturing CUDA graphs to keep allocations out of the graph's pool). fuse_merge: one launch (stage 2
    inside stage 1), with `counters` from decode_attention_counters (>= B rows, >= Hq columns; a fixed one
    under CUDA graphs). v_perm (FP8 pools, N side; ignored elsewhere): V's channels permuted in registers so
    the P V operand loads whole words (the module docstring); the same bits as without it."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if batch == 0:
        return
    kv_group = num_heads // num_kv_heads
    if attn_logits is None:
        attn_logits = decode_attention_workspace(batch, num_heads, head_dim, num_kv_splits, q.device)
    elif attn_logits.shape[1:] != (num_heads, num_kv_splits, head_dim + 1) or attn_logits.shape[0] < batch:
        raise ValueError(f"attn_logits has shape {tuple(attn_logits.shape)}, needs [>={batch}, {num_heads}, "
                         f"{num_kv_splits}, {head_dim + 1}]")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")

    kv_fp8 = k_buffer.element_size() == 1
    block_h = HEAD_BLOCK
    blocks_per_group = triton.cdiv(kv_group, block_h)
    block_d = triton.next_power_of_2(head_dim)
    head_blocks = num_kv_heads * blocks_per_group
    heads_first = heads_first and batch <= 65535  # a grid's y dimension holds at most 65535 programs
    grid1 = (head_blocks, batch, num_kv_splits) if heads_first else (batch, head_blocks, num_kv_splits)
    if fuse_merge:
        if counters is None:
            counters = decode_attention_counters(batch, num_heads, q.device)
        elif counters.shape[0] < batch or counters.shape[1] < head_blocks or counters.dtype != torch.int32:
            raise ValueError(f"counters {tuple(counters.shape)} {counters.dtype} too small for "
                             f"[{batch}, {head_blocks}]")
    pdl = pdl_enabled(q)
    _decode_stage1_kernel[grid1](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, attn_logits, o,
        counters if fuse_merge else seq_lens,  # a placeholder pointer when unused
        sm_scale * _LOG2E * (k_scale if kv_fp8 else 1.0),
        v_scale if kv_fp8 else 1.0,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        o.stride(0), o.stride(1), counters.stride(0) if fuse_merge else 0,
        KV_GROUP=kv_group,
        NUM_SPLITS=num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        VALID_H=min(block_h, kv_group),
        BLOCKS_PER_GROUP=blocks_per_group,
        BLOCK_N=block_n or (32 if block_d > 128 else 64),
        MIN_BLOCK_KV=_MIN_BLOCK_KV,
        WINDOW=max(sliding_window, 0),
        KV_FP8=kv_fp8,
        FUSE_MERGE=fuse_merge,
        F16_MATH=f16_math and kv_fp8 and q.dtype in (torch.bfloat16, torch.float16),  # fp32 keeps fp32
        USE_PDL=pdl,
        HEADS_FIRST=heads_first,
        KV_ROWS_M=kv_rows_m,
        V_PERM=v_perm and kv_fp8 and not kv_rows_m and block_d % 4 == 0,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(pdl),
    )
    if fuse_merge or (num_kv_splits == 1 and not kv_rows_m):  # one split (N side): stage 1 wrote the output
        return
    _decode_stage2_kernel[(batch, num_heads)](
        attn_logits, o, seq_lens,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        o.stride(0), o.stride(1),
        NUM_SPLITS=num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        MIN_BLOCK_KV=_MIN_BLOCK_KV,
        WINDOW=max(sliding_window, 0),
        USE_PDL=pdl,
        num_warps=4,
        **launch_options(pdl),
    )


def decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    sliding_window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain per-request softmax attention in fp32 (over the last sliding_window tokens when > 0);
    returns o [B, Hq, D] in q's dtype. FP8 buffers are read as stored * scale."""
    batch, num_heads, head_dim = q.shape
    kv_group = num_heads // k_buffer.shape[1]
    o = torch.zeros_like(q)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        first = max(0, n - sliding_window) if sliding_window > 0 else 0
        slots = req_to_token[int(req_pool_indices[b]), first:n].long()
        fp8 = k_buffer.element_size() == 1
        k = (k_buffer[slots].float() * (k_scale if fp8 else 1.0)).repeat_interleave(kv_group, dim=1)  # [n, Hq, D]
        v = (v_buffer[slots].float() * (v_scale if fp8 else 1.0)).repeat_interleave(kv_group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale
        o[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return o
