"""Argmax: the greedy sampler's argmax over each row of the logits, in two small launches.

Why: torch's argmax reduces a row with one block, so a batch-1 decode step's argmax over Llama-3's 128,256
logits took 28 us of device time on an H100 (benchmarks/results/tp_step_profile_bs1_2xh100.json); these
two take ~3 us (profile_decode_bs1_argmax_h100.json). The first kernel gives every (row, chunk of BLOCK
columns) its own program, which keeps the chunk's maximum and the first column holding it; the second
takes, per row, the largest chunk maximum and the first column among the chunks holding it. The result is
torch.argmax's: the first index of the maximum (NaN counts as +inf here; torch puts NaN above +inf, which
only matters for a row that holds both)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK = 4096  # columns per first-stage program: 32 programs for a 128k vocabulary's row
_INT_MAX = 2**31 - 1


@triton.jit
def _chunk_argmax_kernel(X, PartV, PartI, V, stride_x, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
                         TOPK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN: +inf, so it is found rather than silently skipped
    for t in tl.static_range(TOPK):  # the chunk's TOPK leaders, best first (a column twice if it runs short)
        best = tl.max(x, 0)
        first = tl.min(tl.where(x == best, offs, 2147483647), 0)
        tl.store(PartV + (row * CHUNKS + chunk) * TOPK + t, best)
        tl.store(PartI + (row * CHUNKS + chunk) * TOPK + t, first)
        if TOPK > 1:
            x = tl.where(offs == first, float("-inf"), x)


@triton.jit
def _row_argmax_kernel(PartV, PartI, Out, CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < CHUNKS
    v = tl.load(PartV + row * CHUNKS + offs, mask=mask, other=float("-inf"))
    i = tl.load(PartI + row * CHUNKS + offs, mask=mask, other=2147483647)
    best = tl.max(v, 0)
    # Chunks are in column order and each holds its own first index, so the smallest index among the
    # chunks that reach the maximum is the row's first.
    tl.store(Out + row, tl.min(tl.where(v == best, i, 2147483647), 0).to(tl.int64))


def _chunk_leaders(logits: torch.Tensor, block: int, topk: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The first stage on the GPU: each (row, chunk)'s `topk` largest values (fp32) and their first columns
    (int32), [rows, chunks * topk]."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(vocab, block)
    part_v = torch.empty(rows, chunks * topk, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(rows, chunks * topk, dtype=torch.int32, device=logits.device)
    if rows:
        _chunk_argmax_kernel[(rows, chunks)](logits, part_v, part_i, vocab, logits.stride(0), CHUNKS=chunks,
                                             BLOCK=block, TOPK=topk, num_warps=min(8, max(1, block // 512)))
    return part_v, part_i


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the first column of each row's maximum of a 2-D float tensor (torch.argmax(dim=-1))."""
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows takes [rows, vocab] logits, got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if vocab == 0 or vocab > _INT_MAX:
        raise ValueError(f"argmax_rows: a vocabulary of {vocab} columns")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    part_v, part_i = _chunk_leaders(logits, BLOCK)
    chunks = part_v.shape[1]
    _row_argmax_kernel[(rows,)](part_v, part_i, out, CHUNKS=chunks, BLOCK_C=triton.next_power_of_2(chunks),
                                num_warps=1)
    return out


def chunk_argmax(logits: torch.Tensor, block: int, topk: int = 1) -> torch.Tensor:
    """int64 [B, cdiv(vocab, block) * topk]: the columns of each row's `topk` largest values within every
    `block` columns (block a power of two; per chunk best first, the first column of a tie; a chunk with
    fewer columns than topk repeats one). The first stage of argmax_rows on CUDA; torch over a padded view
    elsewhere (the same columns, but for which of tied values beyond the first a chunk keeps)."""
    if logits.dim() != 2 or block < 1 or block & (block - 1) or not 1 <= topk <= block:
        raise ValueError(f"chunk_argmax takes [rows, vocab] logits, a power-of-two block and 1 <= topk <= "
                         f"block, got {tuple(logits.shape)}, {block} and {topk}")
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, block)
    if not logits.is_cuda:
        padded = torch.full((rows, chunks * block), float("-inf"), dtype=torch.float32, device=logits.device)
        padded[:, :vocab] = logits.float().nan_to_num(nan=float("inf"))
        view = padded.view(rows, chunks, block)
        idx = view.argmax(dim=-1, keepdim=True) if topk == 1 else view.topk(topk, dim=-1).indices
        idx = (idx + (torch.arange(chunks, device=logits.device) * block)[:, None]).clamp_max(vocab - 1)
        return idx.reshape(rows, chunks * topk)
    return _chunk_leaders(logits, block, topk)[1].to(torch.int64)


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def use_argmax_rows(logits: torch.Tensor) -> bool:
    """Whether the sampler's greedy argmax takes argmax_rows: CUDA, 2-D, a vocabulary of more than one chunk
    (below that torch's one block is as good); SHOAL_FAST_ARGMAX=0 keeps torch's."""
    return (logits.is_cuda and logits.dim() == 2 and logits.shape[1] > BLOCK
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and os.environ.get("SHOAL_FAST_ARGMAX", "1") != "0")
