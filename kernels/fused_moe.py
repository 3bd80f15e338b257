"""Fused MoE: the routed experts' SwiGLU MLPs as two grouped GEMMs over tokens sorted by expert.

Why this shape: a decode step replays a CUDA graph, so the expert computation must launch the same kernels
with the same grids whatever the routing is, and never read a count back to the host. As vLLM's fused_moe
with moe_align_block_size does, the (token, slot) pairs are sorted by expert into blocks of BLOCK_M rows,
each expert's run padded to a whole number of blocks; the padded length has a fixed upper bound
(n + min(E, n) * (BLOCK_M - 1) for n = M * top_k pairs: at most n experts have any), so the grid is fixed
and the blocks past the real end return at once (the end is read on the device). Each block multiplies its
rows by its one expert's weight tile, so only the experts a token chose are read, unlike a dense-masked
formulation (every expert on every token).

moe_align (kernels/moe_align.py) builds the sorted layout in Triton without a host sync: one program up to
128 pairs, three launches over 32-pair chunks past it; its torch form is the reference. Tiles are picked by shape
(pick_config, from benchmarks/sweep_fused_moe.py on H200); the down projection may split K over programs
that write separate fp32 partials, summed with the slots (deterministic, unlike atomics).
fused_moe_ref is the torch reference (per (token, slot): its expert's MLP, weighted).
Under the Triton interpreter tl.dot on bf16 is wrong (kernels/decode_gemm.py): CPU tests use fp32."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import silu_and_mul
from kernels.fp8_act_quant import quantize_per_token_fp8
from kernels.fp8_block_gemm import per_token_group_quant_fp8
from kernels.moe_align import align_length, moe_align, moe_align_torch  # noqa: F401 (moe_align_torch: re-exported)


class MoeConfig(NamedTuple):
    """One grouped GEMM's tiles; block_m is shared by both GEMMs (it shapes the sorted layout)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


class MoeQuant(NamedTuple):
    """FP8 experts: w13 / w2 are float8_e4m3fn and these their fp32 scales (w ~ w8 * scale).
    block None: per output channel, w13_scale [E, 2I], w2_scale [E, H], activations quantized per token;
    block (bn, bk): per bn x bk weight block, [E, ceil(N / bn), K / bk], activations per token and bk-wide
    group (the layout of Qwen3-*-FP8 / DeepSeek checkpoints, weight_block_size [128, 128])."""
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    block: tuple[int, int] | None = None


@triton.jit(do_not_specialize=["num_valid", "row_div"])  # one compile per tile, whatever M and top_k
def _moe_gemm_kernel(A, B, C, Weights, SortedIds, ExpertIds, NumPostPadded, num_valid, row_div, N, K,
                     k_per_split, stride_am, stride_be, stride_bn, stride_cm, stride_cs,
                     AScale, BScale, stride_asm, stride_bse, stride_bsn,
                     MUL_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                     SCALES: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[split][id] = A[id // row_div] @ B[expert(block)]^T (* Weights[id]) over this split's K range.
    SCALES 0: plain; 1: fp8 A and B, times A's per-row and B's per-channel scales at the end; 2: fp8 A and B
    with A's per (row, GROUP_K) and B's per (GROUP_N, GROUP_K) block scales applied each K step (BLOCK_K
    divides GROUP_K, so a step stays inside one group)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    if pid_m * BLOCK_M >= tl.load(NumPostPadded):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(SortedIds + offs_m)
    valid = ids < num_valid  # padding rows hold num_valid
    rows = (ids // row_div).to(tl.int64)
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_lo = pid_s * k_per_split
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    a_ptr = A + rows[:, None] * stride_am + offs_k[None, :]
    b_ptr = B + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr, mask=valid[:, None], other=0.0)
            b = tl.load(b_ptr, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < K - (k0 - k_lo)
            a = tl.load(a_ptr, mask=valid[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptr, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if SCALES == 2:
            a_s = tl.load(AScale + rows * stride_asm + k0 // GROUP_K, mask=valid, other=0.0)
            b_s = tl.load(BScale + expert * stride_bse + (offs_n // GROUP_N) * stride_bsn + k0 // GROUP_K,
                          mask=mask_n, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        elif SCALES == 1:
            # a fresh dot each K step, added in fp32: Hopper's fp8 MMA keeps ~14 bits in its own accumulator
            # (DeepSeek-V3 §3.3.2), and chained over K 2048 it ended 2.5% off the reference on an H200
            acc += tl.dot(a, b)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    if SCALES == 1:
        acc = acc * tl.load(AScale + rows, mask=valid, other=0.0)[:, None] \
            * tl.load(BScale + expert * stride_bse + offs_n, mask=mask_n, other=0.0)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(Weights + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = C + pid_s.to(tl.int64) * stride_cs + ids[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(C.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def rows_per_expert(num_tokens: int, top_k: int, num_experts: int) -> float:
    """The mean rows of a used expert: what a block's height has to fit."""
    pairs = num_tokens * top_k
    return pairs / max(1, min(num_experts, pairs))


def pick_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """16-row blocks while a used expert gets <= 4 rows (decode), 32 to 32 rows, then 64, 128 past 128."""
    r = rows_per_expert(num_tokens, top_k, num_experts)
    return 16 if r <= 4 else 32 if r <= 32 else 64 if r <= 128 else 128


def pick_config(num_tokens: int, top_k: int, num_experts: int, n: int, k: int, down: bool) -> MoeConfig:
    """The tiles for one grouped GEMM (out [M * top_k, n], reduction k) at this batch.

    Why (benchmarks/results/fused_moe_sweep_h200.json: Qwen3-30B-A3B and Mixtral-8x7B shapes, M 1-1024):
    at <= 4 rows an expert the GEMMs stream weights, and the old 64-wide K steps at 3 stages kept too little
    in flight (Mixtral's down at M 1: 103 us, 58 with 128-wide steps); 256-wide K steps gain 1-4% on gate_up,
    128-wide N tiles and a 2-way K split on a long-K down projection whose programs fill under one wave
    (Mixtral at M 1). Past 4 rows 32-row blocks, past 32 the 64 x 128 tile, past 128 rows 128 x 256 at 8
    warps (Mixtral's two GEMMs at M 1024: 1.55 ms against 2.54 with the old 64 x 64 tiles). Splitting K
    where the programs already fill a wave lost 5-17%."""
    block_m = pick_block_m(num_tokens, top_k, num_experts)
    long_k = k >= 4096
    if block_m == 16:
        block_n, block_k, warps, stages = ((128, 128, 4, 3) if long_k else (64, 128, 4, 4)) if down else (64, 256, 4, 3)
    elif block_m == 32:
        block_n, block_k, warps, stages = (128, 128, 8, 3) if down and long_k else (64, 128, 4, 4)
    elif block_m == 64:
        block_n, block_k, warps, stages = 128, 64, 4, 3
    else:
        block_n, block_k, warps, stages = 256, 64, 8, 4
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    split = 1
    if down and block_m == 16:
        # programs under one wave (132 SMs on H100/H200), each streaming a long K: split K so more SMs read
        pairs = num_tokens * top_k
        programs = max(min(num_experts, pairs), triton.cdiv(pairs, block_m)) * triton.cdiv(n, block_n)
        while split < 8 and programs * split * 2 <= 132 and k // (split * 2) >= 2048:
            split *= 2
    return MoeConfig(block_m, block_n, block_k, warps, stages, split)


def _moe_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None,
              align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], row_div: int, cfg: MoeConfig,
              scales: tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None] | None = None) -> None:
    """out [splits, M * top_k, n] (splits 1 unless cfg splits K, fp32 then: the caller sums them).
    scales: (a's, w's, block) for fp8 a and w (MoeQuant's layouts; a's from quantize_moe_input)."""
    sorted_ids, expert_ids, total = align
    n, k = w.shape[1], w.shape[2]
    mode, group_n, group_k = 0, 1, 1
    a_scale = b_scale = out
    if scales is not None:
        a_scale, b_scale, block = scales
        mode = 1 if block is None else 2
        if block is not None:
            group_n, group_k = block
            if group_k % cfg.block_k:
                raise ValueError(f"_moe_gemm: BLOCK_K {cfg.block_k} must divide the scale group {group_k}")
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    if out.dim() != 3 or out.shape[0] != splits:
        raise ValueError(f"_moe_gemm: out {tuple(out.shape)} needs {splits} split(s) first")
    grid = (expert_ids.numel(), triton.cdiv(n, cfg.block_n), splits)
    _moe_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out, sorted_ids, expert_ids, total, out.shape[1], row_div,
        n, k, k_per_split, a.stride(0), w.stride(0), w.stride(1), out.stride(1), out.stride(0),
        a_scale, b_scale, a_scale.stride(0) if mode == 2 else 0, b_scale.stride(0) if mode else 0,
        b_scale.stride(1) if mode == 2 else 0,
        MUL_WEIGHT=weights is not None, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        EVEN_K=k % cfg.block_k == 0, SCALES=mode, GROUP_N=group_n, GROUP_K=group_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def num_splits(k: int, cfg: MoeConfig) -> int:
    """How many K ranges cfg's split_k gives for reduction length k (whole BLOCK_K steps each)."""
    return triton.cdiv(k, triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k)


# Tokens per fused_moe pass. Why: each pass allocates [rows * top_k, 2I] (x's dtype), the activation
# [rows * top_k, I] and fp32 [splits, rows * top_k, H] outside the KV-cache memory accounting; for Mixtral an
# 8k-token prefill chunk in one pass is ~1.7 GB, 2048 tokens ~0.4 GB. vLLM bounds the same with
# VLLM_FUSED_MOE_CHUNK_SIZE (32768 rows, too loose for this). 2048 rows is past the 128-row tile's
# knee (pick_config), so longer prefills lose little, and above any captured decode batch (cuda_graph_max_bs
# 512 by default); the split is by shape only, so it stays CUDA-graph safe either way.
CHUNK_TOKENS = 2048
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_moe_input(x: torch.Tensor, group_k: int | None, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (fp8 [M, K], fp32 scales): per row [M] (group_k None) or per row and group_k-wide group
    [M, K / group_k], scale = amax / 448 (an all-zero group keeps a finite one). Dynamic, as vLLM's
    per_token(_group)_quant_fp8; no host sync. gated: x is gate_up [M, 2K] and silu(gate) * up (rounded to
    x's dtype, as silu_and_mul stores it) is quantized.
    On CUDA one launch (kernels/fp8_act_quant.py, fp8_block_gemm.py: the torch form's bits): the torch form
    was ~8 launches per call, two calls a layer, and made Qwen3-30B-A3B's FP8 batch-1 step slower than bf16's
    (5.28 against 4.53 ms on an H200)."""
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    if group_k is not None and k % group_k:
        raise ValueError(f"quantize_moe_input: K {k} is not a multiple of the scale group {group_k}")
    if x.is_cuda:
        if group_k is None:
            q, s = quantize_per_token_fp8(x, gated=gated)
            return q, s.view(m)
        return per_token_group_quant_fp8(x, group_k, gated=gated)
    return quantize_moe_input_torch(silu_and_mul(x) if gated else x, group_k)


def quantize_moe_input_torch(x: torch.Tensor, group_k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_moe_input in torch ops (CPU; the reference of the CUDA launches)."""
    m, k = x.shape
    g = x.float().view(m, -1, group_k if group_k is not None else k)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12) / FP8_MAX
    q = (g / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(m, k)
    return q, scale.view(m, -1) if group_k is not None else scale.view(m)


def round_through_fp8(x: torch.Tensor, group_k: int | None) -> torch.Tensor:
    """x [M, K] as the fp8 GEMMs see it (quantize_moe_input, then back), in fp32."""
    q, s = quantize_moe_input(x, group_k)
    m = x.shape[0]
    return (q.float().view(m, s.numel() // m, -1) * s.view(m, -1, 1)).view(x.shape)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, configs: tuple[MoeConfig, MoeConfig] | None = None,
              quant: MoeQuant | None = None) -> torch.Tensor:
    """sum over slots j of topk_weights[t, j] * (silu(x W1^T) * (x W3^T)) W2^T with expert topk_ids[t, j].

    x [M, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_* [M, k]. Returns [M, H] in
    x's dtype (the weighted slots are summed in fp32). configs: (gate_up, down) tiles, pick_config's by
    default (per pass of at most CHUNK_TOKENS tokens; benchmarks pass others). quant: fp8 experts (both
    GEMMs' inputs quantized dynamically, MoeQuant). No host synchronization: CUDA-graph safe."""
    m, k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    if x.shape != (m, hidden) or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} and "
                         f"topk_ids {tuple(topk_ids.shape)} do not fit together")
    if configs is not None and (configs[0].block_m != configs[1].block_m or configs[0].split_k != 1):
        raise ValueError(f"fused_moe: configs {configs} must share block_m, and only the down GEMM splits K")
    if m == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    if m <= CHUNK_TOKENS:
        return _fused_moe_pass(x, w13, w2, topk_weights, topk_ids, configs, quant)
    out = torch.empty_like(x)
    for start in range(0, m, CHUNK_TOKENS):  # tokens are independent: each pass is a slice of the whole
        end = min(start + CHUNK_TOKENS, m)
        out[start:end] = _fused_moe_pass(x[start:end], w13, w2, topk_weights[start:end], topk_ids[start:end],
                                         configs, quant)
    return out


def _fused_moe_pass(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, configs: tuple[MoeConfig, MoeConfig] | None,
                    quant: MoeQuant | None = None) -> torch.Tensor:
    """fused_moe over one pass's rows (x contiguous, shapes checked)."""
    m, k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    if configs is None:
        configs = (pick_config(m, k, num_experts, two_i, hidden, down=False),
                   pick_config(m, k, num_experts, hidden, two_i // 2, down=True))
    group_k = quant.block[1] if quant is not None and quant.block is not None else None
    if group_k is not None:  # a K step inside one scale group
        configs = tuple(c._replace(block_k=min(c.block_k, group_k)) for c in configs)  # type: ignore[assignment]
    up_cfg, down_cfg = configs
    align = moe_align(topk_ids, num_experts, up_cfg.block_m)
    gate_up = torch.empty((1, m * k, two_i), dtype=x.dtype, device=x.device)
    up_scales = down_scales = None
    a = x
    if quant is not None:
        a, a_scale = quantize_moe_input(x, group_k)
        up_scales = (a_scale, quant.w13_scale, quant.block)
    _moe_gemm(a, w13, gate_up, None, align, k, up_cfg, up_scales)
    if quant is None:
        act = silu_and_mul(gate_up[0])
    else:  # the SiLU-and-mul inside the quantize launch
        act, act_scale = quantize_moe_input(gate_up[0], group_k, gated=True)
        down_scales = (act_scale, quant.w2_scale, quant.block)
    splits = num_splits(two_i // 2, down_cfg)
    down = torch.empty((splits, m * k, hidden), dtype=torch.float32, device=x.device)
    _moe_gemm(act, w2, down, topk_weights.reshape(-1).contiguous(), align, 1, down_cfg, down_scales)
    return down.view(splits, m, k, hidden).sum(dim=(0, 2)).to(x.dtype)


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """fp8 expert stack [E, N, K] with MoeQuant's scales → fp32 [E, N, K]."""
    if block is None:
        return w.float() * scale.float()[:, :, None]
    n, k = w.shape[1:]
    s = scale.float().repeat_interleave(block[0], dim=1)[:, :n].repeat_interleave(block[1], dim=2)[:, :, :k]
    return w.float() * s


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, quant: MoeQuant | None = None) -> torch.Tensor:
    """The torch reference of fused_moe: one (token, slot) at a time, fp32. With quant, the same dynamic
    input quantization as fused_moe (its rounding is part of the model), on dequantized weights."""
    group_k = quant.block[1] if quant is not None and quant.block is not None else None

    def rounded(v: torch.Tensor) -> torch.Tensor:
        return v.float() if quant is None else round_through_fp8(v, group_k)

    if quant is not None:
        w13, w2 = dequantize_experts(w13, quant.w13_scale, quant.block), dequantize_experts(w2, quant.w2_scale,
                                                                                              quant.block)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(topk_ids.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            # the kernel stores gate_up in x's dtype and silu_and_mul reads it back: round as it does, or the
            # fp8 requantization below turns a bf16 ulp into an fp8 one (a different row scale moves every value)
            gate, up = (w13[e].float() @ rounded(x[t:t + 1])[0]).to(x.dtype).float().chunk(2)
            act = (F.silu(gate) * up).to(x.dtype)[None]
            out[t] += float(topk_weights[t, j]) * (w2[e].float() @ rounded(act)[0])
    return out.to(x.dtype)
