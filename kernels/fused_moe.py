"""Fused MoE: the routed experts' SwiGLU MLPs as two grouped GEMMs over tokens sorted by expert.

Why this shape: a decode step replays a CUDA graph, so the expert computation must launch the same kernels
with the same grids whatever the routing is, and never read a count back to the host. As vLLM's fused_moe
with moe_align_block_size does, the (token, slot) pairs are sorted by expert into blocks of BLOCK_M rows,
each expert's run padded to a whole number of blocks; the padded length has a fixed upper bound
(M * top_k + E * (BLOCK_M - 1)), so the grid is fixed and the blocks past the real end return at once
(the end is read on the device). Each block multiplies its rows by its one expert's weight tile, so only
the experts a token chose are read, unlike a dense-masked formulation (every expert on every token).

moe_align builds the sorted layout with torch ops that never synchronize (scatter_add, a stable argsort,
searchsorted); fused_moe_ref is the torch reference (per (token, slot): its expert's MLP, weighted).
Under the Triton interpreter tl.dot on bf16 is wrong (kernels/decode_gemm.py): CPU tests use fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import silu_and_mul


@triton.jit
def _moe_gemm_kernel(A, B, C, Weights, SortedIds, ExpertIds, NumPostPadded, num_valid, N, K,
                     stride_am, stride_be, stride_bn, stride_cm,
                     ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[id] = A[id // ROW_DIV] @ B[expert(block)]^T (* Weights[id]) for the ids of this block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPostPadded):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(SortedIds + offs_m)
    valid = ids < num_valid  # padding rows hold num_valid
    rows = (ids // ROW_DIV).to(tl.int64)
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    b_base = B + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(A + rows[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                    other=0.0)
        b = tl.load(b_base + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(Weights + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = C + ids[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(C.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def pick_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """16-row blocks where an expert gets few rows (decode), 64 where most get many (prefill)."""
    return 16 if num_tokens * top_k <= 4 * num_experts else 64


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [M, k] → (sorted_ids int32 [L], expert_ids int32 [L / block_m], num_post_padded int32 [1]).

    sorted_ids lists the flat (token * k + slot) ids expert by expert, each expert's run padded with
    M * k to a multiple of block_m; expert_ids is each block's expert. L = M * k + E * (block_m - 1) rounded
    up to block_m, a bound that does not depend on the routing (fixed shapes for CUDA graphs)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    # position of each sorted pair inside its expert's run, then where that run starts once padded
    rank = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (ends - padded)[sorted_experts] + rank
    length = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((length,), n, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, length, block_m, device=flat.device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


def _moe_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None,
              align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], row_div: int, block_m: int) -> None:
    sorted_ids, expert_ids, total = align
    n, k = w.shape[1], w.shape[2]
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (expert_ids.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out, sorted_ids, expert_ids, total, out.shape[0], n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROW_DIV=row_div, MUL_WEIGHT=weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """sum over slots j of topk_weights[t, j] * (silu(x W1^T) * (x W3^T)) W2^T with expert topk_ids[t, j].

    x [M, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_* [M, k]. Returns [M, H] in
    x's dtype (the weighted slots are summed in fp32). No host synchronization: CUDA-graph safe."""
    m, k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    if x.shape != (m, hidden) or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} and "
                         f"topk_ids {tuple(topk_ids.shape)} do not fit together")
    if m == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    block_m = pick_block_m(m, k, num_experts)
    align = moe_align(topk_ids, num_experts, block_m)
    gate_up = torch.empty((m * k, two_i), dtype=x.dtype, device=x.device)
    _moe_gemm(x, w13, gate_up, None, align, k, block_m)
    act = silu_and_mul(gate_up)
    down = torch.empty((m * k, hidden), dtype=torch.float32, device=x.device)
    _moe_gemm(act, w2, down, topk_weights.reshape(-1).contiguous(), align, 1, block_m)
    return down.view(m, k, hidden).sum(dim=1).to(x.dtype)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The torch reference of fused_moe: one (token, slot) at a time, fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(topk_ids.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            out[t] += float(topk_weights[t, j]) * (w2[e].float() @ (F.silu(gate) * up))
    return out.to(x.dtype)
