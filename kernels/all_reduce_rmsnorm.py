"""AllReduceRMSNorm: a one-shot all-reduce over symmetric memory fused with the residual add and RMSNorm
that follow it in a decoder layer (TP's o_proj / down_proj partial sums → post-attention / next input norm).

One launch replaces two (the one-shot all-reduce, then kernels/rmsnorm.py's fused add): each program copies
its rows of this rank's partial sum into this rank's symmetric buffer, meets the same program on every peer
at a barrier (below), sums the rows of every rank's buffer in rank order in fp32, rounds the sum once to
the activation dtype (what NCCL and torch's one-shot kernel give for two ranks: a + b correctly rounded),
then adds the residual and normalises exactly as _rmsnorm_kernel does, so for two ranks the output and the
new residual are bit-equal to all_reduce followed by fused_add_rmsnorm. Above two ranks the sum's order is
fixed (rank 0 first) on every rank, so the ranks still agree with each other.

Synchronisation: epoch flags, as vLLM's and SGLang's custom all-reduce kernels synchronise, rather than the
0 → 1 → 0 compare-and-swaps torch's symmetric-memory kernels use: a remote CAS waits a full NVLink round
trip for its old value, a flag write does not (its result is never read). Every rank owns a zero-filled
int64 flag area in symmetric memory (flag_slots): arrival slots [program, peer] that peers write, then one
local counter per program. A call's program p reads its counter c and meets its peers at epoch c + 1: to
arrive it writes the epoch into slot [p, my rank] of each peer's area (release, system scope); to wait it
reads its own slot [p, peer] (acquire) until the value is at least the epoch. Waiting for "at least" lets a
peer run one call ahead and overwrite the slot without losing the arrival; the flags only grow (int64: no
wrap), so nothing needs resetting and CUDA-graph replays stay in step. The ranks' counters agree because
every rank makes the same calls with the same row counts (a collective). A CTA barrier before the arrival
publishes every thread's stores; one after the wait lets every thread read what the peers published.

One barrier per call, not two: the symmetric buffer has two halves and program p's call c stages its rows
in half c % 2. A rank writes a half again only in call c + 2 of that program, after it has met every peer
at call c + 1, and a peer arrives there only once its call c (an earlier kernel, complete) has read the
rows. That needs each row to belong to the same program in every call, whatever the row count: programs are
persistent (at most MAX_PROGRAMS, each taking rows pid, pid + G, ... with G = min(rows, MAX_PROGRAMS)), so
row r is always program r % MAX_PROGRAMS's. Persistent programs are also all resident at once, so no
barrier waits on a program the GPU has not scheduled. The second barrier this replaces (after the reads,
before the kernel may end) cost each of a 32-layer decode step's 64 calls a further NVLink round trip.

Under programmatic dependent launch the norm weight is loaded before the wait; nothing symmetric is
touched before it. The Triton interpreter runs it on CPU (pointer casts and atomics work there), which
the CPU test uses with peers whose arrivals are pre-signalled."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enabled
from kernels.rmsnorm import fused_add_rmsnorm_ref, norm_row_entry, rmsnorm_ref

MAX_PROGRAMS = 128  # persistent programs: resident on any sm80+ GPU at once (one per SM at most)


def flag_slots(world: int) -> int:
    """int64 slots of one rank's flag area: arrivals [MAX_PROGRAMS, world], then MAX_PROGRAMS epochs."""
    return MAX_PROGRAMS * (world + 1)


@triton.jit
def _arrive_and_wait(Flags, pid, epoch, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Meet the program with the same pid on every peer at `epoch` (see the module docstring)."""
    tl.debug_barrier()  # every thread's stores to the symmetric buffer precede the release below
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer = tl.load(Flags + r).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(peer + pid * WORLD + RANK, epoch, sem="release", scope="sys")
    mine = tl.load(Flags + RANK).to(tl.pointer_type(tl.int64))
    for r in tl.static_range(WORLD):
        if r != RANK:
            while tl.atomic_add(mine + pid * WORLD + r, 0, sem="acquire", scope="sys") < epoch:
                pass
    tl.debug_barrier()  # the peers' rows, acquired by one thread, are visible to all of them


@triton.jit
def _all_reduce_add_rmsnorm_kernel(
    X, Residual, W, Out, Bufs, Flags, M, half_numel, stride_x, stride_r, stride_o, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
    MAX_PROGS: tl.constexpr, ADD_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    offs, mask, w = norm_row_entry(W, HIDDEN, BLOCK, USE_PDL)
    # This program's call counter: only this program of this rank touches it, one call after another.
    counter = tl.load(Flags + RANK).to(tl.pointer_type(tl.int64)) + MAX_PROGS * WORLD + pid
    count = tl.load(counter)
    epoch = count + 1
    half = (count % 2) * half_numel  # this call's half of every rank's buffer (module docstring)
    my_buf = tl.load(Bufs + RANK).to(tl.pointer_type(X.dtype.element_ty)) + half
    # 32-bit offsets: rows x hidden of a graph-sized batch stays far below 2**31.
    for row in range(pid, M, progs):
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
        tl.store(my_buf + row * HIDDEN + offs, x, mask=mask)
    _arrive_and_wait(Flags, pid, epoch, RANK, WORLD)
    for row in range(pid, M, progs):
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for r in tl.static_range(WORLD):
            peer = tl.load(Bufs + r).to(tl.pointer_type(X.dtype.element_ty)) + half
            acc += tl.load(peer + row * HIDDEN + offs, mask=mask, other=0.0).to(tl.float32)
        x = acc.to(X.dtype.element_ty).to(tl.float32)  # the all-reduced value, rounded once
        if ADD_RESIDUAL:
            res = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
            s = (x + res).to(Residual.dtype.element_ty)  # rounded as _rmsnorm_kernel rounds it
            tl.store(Residual + row * stride_r + offs, s, mask=mask)
            x = s.to(tl.float32)
        variance = tl.sum(x * x, 0) / HIDDEN
        out = x * tl.rsqrt(variance + eps) * w
        tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)
    tl.store(counter, epoch)


def num_programs(rows: int) -> int:
    return max(1, min(rows, MAX_PROGRAMS))


def all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                           buffer_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, rank: int, world: int,
                           half_numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = rmsnorm(residual + sum over ranks of x) * weight, with residual updated in place to that sum
    (or, with residual None, out = rmsnorm(sum of x) * weight). x [M, hidden] is this rank's partial sum;
    buffer_ptrs / flag_ptrs: int64 tensors on x's device with every rank's symmetric buffer (two halves of
    half_numel elements of x's dtype, each with room for M x hidden, used by nothing else) and flag area
    (zero-filled at first, flag_slots(world) int64 slots, used by nothing else). Collective: every rank
    calls it with the same M, in the same order."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [rows, hidden] and contiguous in hidden, got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if weight.numel() != x.shape[1]:
        raise ValueError(f"norm weight has {weight.numel()} values for hidden size {x.shape[1]}")
    if buffer_ptrs.numel() != world or flag_ptrs.numel() != world or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world}: expected {world} buffer and flag-area pointers")
    if x.numel() > half_numel:
        raise ValueError(f"{tuple(x.shape)} does not fit a buffer half of {half_numel} elements")
    m, hidden = x.shape
    if out is None:
        out = torch.empty_like(x)
    if m == 0:
        return out
    pdl = pdl_enabled(x)
    res = residual if residual is not None else x
    _all_reduce_add_rmsnorm_kernel[(num_programs(m),)](
        x, res, weight, out, buffer_ptrs, flag_ptrs, m, half_numel, x.stride(0), res.stride(0), out.stride(0), eps,
        HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden), RANK=rank, WORLD=world, MAX_PROGS=MAX_PROGRAMS,
        ADD_RESIDUAL=residual is not None, USE_PDL=pdl,
        num_warps=max(1, min(16, triton.next_power_of_2(hidden) // 256)), **launch_options(pdl),
    )
    return out


def all_reduce_add_rmsnorm_ref(partials: list[torch.Tensor], residual: torch.Tensor | None, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference for every rank: the rank-ordered fp32 sum rounded once, then kernels/rmsnorm.py's
    reference (residual returned new, not updated)."""
    acc = partials[0].float()
    for p in partials[1:]:
        acc = acc + p.float()
    total = acc.to(partials[0].dtype)
    if residual is None:
        return rmsnorm_ref(total, weight, eps), None
    new_res = residual.clone()
    fused_add_rmsnorm_ref(total, new_res, weight, eps)
    return total, new_res
