"""moe_align: the (token, slot) pairs of a top-k routing sorted by expert into blocks of BLOCK_M rows, each
expert's run padded to whole blocks (the layout kernels/fused_moe's grouped GEMMs read), with a length fixed
by M, k and E so a CUDA graph replays it whatever the routing.

Two Triton forms, one result: up to SINGLE_MAX pairs one program does it all (counts, padded offsets, a
stable scatter, pads, block experts), a batch-1 decode step's cheapest launch (3.7 us at E 128 on an H200);
its serial chunks cost ~0.35 us per 8 pairs at E 128 (91 us at 2,048 pairs, a 256-row decode step, paid in
each of 48 layers), so past it three launches split the pairs into chunks of CHUNK: each chunk counts its
experts, one program turns the [chunks, E] counts into every chunk's write offset per expert (and the pads,
block experts and total), then each chunk scatters its pairs: 10.7 us at 2,048 pairs, 40 at 16,384
(benchmarks/results/moe_align_h200.json). Both are stable (ascending ids within an
expert), as moe_align_torch, the reference in torch ops (~25 small kernels, no host sync)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SINGLE_MAX = 128  # pairs: the one-program form up to here (the crossing: 96-192 pairs at E 128 / E 8, H200)
CHUNK = 32  # pairs a chunk program holds: its [CHUNK, CHUNK] same-expert-before test stays small


@triton.jit
def _write_pads_and_experts(SortedIds, ExpertIds, NumPostPadded, counts, padded, starts, ends, total, n,
                            NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_CHUNK: tl.constexpr):
    """Both forms' last step, from the experts' counts and padded runs: each run's pad rows (fewer than
    BLOCK_M, all runs at once), each block's expert (how many runs end at or before its first row), the total."""
    pad = tl.arange(0, BLOCK_M)
    tl.store(SortedIds + (starts + counts)[:, None] + pad[None, :], tl.zeros((E_POW2, BLOCK_M), tl.int32) + n,
             mask=pad[None, :] < (padded - counts)[:, None])
    for b0 in range(0, total // BLOCK_M, BLOCK_CHUNK):
        blocks = b0 + tl.arange(0, BLOCK_CHUNK)
        f = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(ExpertIds + blocks, tl.minimum(f, NUM_EXPERTS - 1), mask=blocks * BLOCK_M < total)
    tl.store(NumPostPadded, total)


@triton.jit
def _moe_align_kernel(TopkIds, SortedIds, ExpertIds, NumPostPadded, n,
                      NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    """moe_align in one program: counts, padded runs, a stable scatter, then the pads and block experts.
    Only [0, total) is written: the GEMMs never read past it."""
    experts = tl.arange(0, E_POW2)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for i0 in range(0, n, CHUNK):
        offs = i0 + tl.arange(0, CHUNK)
        e = tl.load(TopkIds + offs, mask=offs < n, other=-1).to(tl.int32)  # -1 matches no expert
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    # a pair's place: its run's start + the pairs of its expert before it (earlier chunks, then this one)
    seen = tl.zeros((E_POW2,), dtype=tl.int32)
    for i0 in range(0, n, CHUNK):
        offs = i0 + tl.arange(0, CHUNK)
        e = tl.load(TopkIds + offs, mask=offs < n, other=-1).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        base = tl.sum(onehot * (starts + seen)[None, :], axis=1)
        before = (e[:, None] == e[None, :]) & (offs[None, :] < offs[:, None])
        local = tl.sum(before.to(tl.int32), axis=1)
        tl.store(SortedIds + base + local, offs, mask=offs < n)
        seen += tl.sum(onehot, axis=0)
    _write_pads_and_experts(SortedIds, ExpertIds, NumPostPadded, counts, padded, starts, ends, total, n,
                            NUM_EXPERTS, E_POW2, BLOCK_M, BLOCK_CHUNK)


@triton.jit
def _chunk_counts_kernel(TopkIds, Counts, n, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """Counts[chunk, e]: the pairs of this chunk routed to expert e."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(TopkIds + offs, mask=offs < n, other=-1).to(tl.int32)
    experts = tl.arange(0, E_POW2)
    tl.store(Counts + c * E_POW2 + experts, tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0))


@triton.jit
def _chunk_offsets_kernel(Counts, Offsets, SortedIds, ExpertIds, NumPostPadded, num_chunks, n,
                          NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    """One program: the experts' padded runs from the chunks' counts, then Offsets[chunk, e] = where chunk's
    first pair of expert e goes (its run's start + the earlier chunks' pairs of e); the pads and each block's
    expert as the one-program kernel writes them."""
    experts = tl.arange(0, E_POW2)
    rows = tl.arange(0, ROWS)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for r0 in range(0, num_chunks, ROWS):
        tile = tl.load(Counts + (r0 + rows)[:, None] * E_POW2 + experts[None, :],
                       mask=(r0 + rows)[:, None] < num_chunks, other=0)
        counts += tl.sum(tile, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    carry = starts
    for r0 in range(0, num_chunks, ROWS):
        live = (r0 + rows)[:, None] < num_chunks
        tile = tl.load(Counts + (r0 + rows)[:, None] * E_POW2 + experts[None, :], mask=live, other=0)
        tl.store(Offsets + (r0 + rows)[:, None] * E_POW2 + experts[None, :],
                 carry[None, :] + tl.cumsum(tile, axis=0) - tile, mask=live)
        carry += tl.sum(tile, axis=0)
    _write_pads_and_experts(SortedIds, ExpertIds, NumPostPadded, counts, padded, starts, ends, total, n,
                            NUM_EXPERTS, E_POW2, BLOCK_M, BLOCK_CHUNK)


@triton.jit
def _chunk_scatter_kernel(TopkIds, Offsets, SortedIds, n, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """Each pair of this chunk to its expert's offset + the chunk's pairs of that expert before it."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    live = offs < n
    e = tl.load(TopkIds + offs, mask=live, other=-1).to(tl.int32)
    base = tl.load(Offsets + c * E_POW2 + e, mask=live, other=0)
    local = tl.sum(((e[:, None] == e[None, :]) & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)
    tl.store(SortedIds + base + local, offs, mask=live)


def align_length(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The sorted layout's fixed length: each of the at most min(E, n) used experts pads < block_m rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, use_kernel: bool | None = None,
              single_max: int = SINGLE_MAX) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [M, k] → (sorted_ids int32 [L], expert_ids int32 [L / block_m], num_post_padded int32 [1]).

    sorted_ids lists the flat (token * k + slot) ids expert by expert (stable: ascending within an expert),
    each expert's run padded with M * k to a multiple of block_m; expert_ids is each block's expert. The
    length L (align_length) does not depend on the routing (fixed shapes for CUDA graphs); entries past
    num_post_padded are left unwritten (the GEMMs' blocks there return before reading them).

    use_kernel False: the torch reference; else the Triton forms, one program up to single_max pairs, chunked
    past it (benchmarks/bench_moe_align.py times each form by moving single_max)."""
    if use_kernel is False:
        return moe_align_torch(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    length = align_length(n, num_experts, block_m)
    sorted_ids = torch.empty((length,), dtype=torch.int32, device=flat.device)
    expert_ids = torch.empty((length // block_m,), dtype=torch.int32, device=flat.device)
    total = torch.empty((1,), dtype=torch.int32, device=flat.device)
    e_pow2 = triton.next_power_of_2(num_experts)
    if n <= single_max:
        chunk = 32 if e_pow2 >= 128 else 64  # the [chunk, E] one-hot tiles stay in registers
        _moe_align_kernel[(1,)](flat, sorted_ids, expert_ids, total, n, NUM_EXPERTS=num_experts, E_POW2=e_pow2,
                                BLOCK_M=block_m, CHUNK=chunk, BLOCK_CHUNK=64, num_warps=4)
        return sorted_ids, expert_ids, total
    chunks = triton.cdiv(n, CHUNK)
    counts = torch.empty((chunks, e_pow2), dtype=torch.int32, device=flat.device)
    offsets = torch.empty_like(counts)
    _chunk_counts_kernel[(chunks,)](flat, counts, n, E_POW2=e_pow2, CHUNK=CHUNK, num_warps=1)
    _chunk_offsets_kernel[(1,)](counts, offsets, sorted_ids, expert_ids, total, chunks, n,
                                NUM_EXPERTS=num_experts, E_POW2=e_pow2, BLOCK_M=block_m,
                                ROWS=max(1, 4096 // e_pow2), BLOCK_CHUNK=64, num_warps=4)
    _chunk_scatter_kernel[(chunks,)](flat, offsets, sorted_ids, n, E_POW2=e_pow2, CHUNK=CHUNK, num_warps=1)
    return sorted_ids, expert_ids, total


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align in torch ops that never synchronize (the reference; every entry of L written)."""
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
    length = align_length(n, num_experts, block_m)
    sorted_ids = torch.full((length,), n, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, length, block_m, device=flat.device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)
