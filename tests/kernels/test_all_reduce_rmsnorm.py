"""The fused one-shot all-reduce + residual add + RMSNorm (kernels/all_reduce_rmsnorm.py) in the Triton
interpreter: the ranks of a group run one after another in this process over ordinary CPU tensors standing
in for the symmetric buffers, each rank's peers that have not run yet "already arrived" (their rows copied
into their buffers, their signals set in its pad). Checks every rank's output and residual against the
reference (fp32 and fp16: the interpreter's bf16 rounding differs from torch's at ties; bf16 runs on 2 GPUs,
tests/gpu/test_all_reduce_rmsnorm_gpu.py) and the signal pads' protocol: each barrier consumes the signals it
waited for. The real cross-GPU ordering is only exercised on GPUs."""

from __future__ import annotations

import pytest
import torch

from kernels.all_reduce_rmsnorm import (
    all_reduce_add_rmsnorm,
    all_reduce_add_rmsnorm_ref,
    num_programs,
    signal_slots_needed,
)

HIDDEN, EPS = 48, 1e-5


def _simulate(world: int, rows: int, dtype: torch.dtype, with_residual: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    partials = [torch.randn(rows, HIDDEN, generator=gen).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, HIDDEN, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    bufs = [torch.zeros(rows * HIDDEN + 16, dtype=dtype) for _ in range(world)]
    slots = signal_slots_needed(rows, world)
    pads = [torch.zeros(slots, dtype=torch.int32) for _ in range(world)]
    buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    pad_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    progs = num_programs(rows)
    outs, residuals = [], []
    for rank in range(world):
        for later in range(rank + 1, world):  # peers yet to run: arrived, rows in place
            bufs[later][: rows * HIDDEN].copy_(partials[later].reshape(-1))
            pads[rank].view(2 * progs, world)[:, later] = 1
        res = residual.clone() if residual is not None else None
        outs.append(all_reduce_add_rmsnorm(partials[rank].clone(), res, weight, EPS, buf_ptrs, pad_ptrs, rank, world))
        residuals.append(res)
    return partials, residual, weight, outs, residuals, pads, progs


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_rank_gets_the_reference(world: int, rows: int, dtype: torch.dtype) -> None:
    partials, residual, weight, outs, residuals, pads, progs = _simulate(world, rows, dtype, True)
    want_out, want_res = all_reduce_add_rmsnorm_ref(partials, residual, weight, EPS)
    for rank in range(world):
        assert torch.equal(residuals[rank], want_res), f"rank {rank} residual"
        torch.testing.assert_close(outs[rank], want_out, rtol=0, atol=2e-6 if dtype == torch.float32 else 1e-3)
        assert torch.equal(outs[rank], outs[0])  # the ranks agree bit for bit
    # Every wait consumed its signal; what is left is each later rank's second (real) arrival at an earlier
    # rank, which the simulation had already granted.
    for rank in range(world):
        grid = pads[rank].view(2 * progs, world)
        for peer in range(world):
            assert int(grid[:, peer].sum()) == (2 * progs if peer > rank else 0), (rank, peer)


def test_without_residual_is_the_plain_norm_of_the_sum() -> None:
    partials, _, weight, outs, residuals, _, _ = _simulate(2, 3, torch.float32, False)
    want, _ = all_reduce_add_rmsnorm_ref(partials, None, weight, EPS)
    assert residuals == [None, None]
    for out in outs:
        torch.testing.assert_close(out, want, rtol=0, atol=2e-6)


def test_more_rows_than_programs_share_one_barrier_per_program(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import all_reduce_rmsnorm

    monkeypatch.setattr(all_reduce_rmsnorm, "MAX_PROGRAMS", 2)
    partials, residual, weight, outs, residuals, _, progs = _simulate(2, 5, torch.float32, True)
    assert progs == 2
    want_out, want_res = all_reduce_add_rmsnorm_ref(partials, residual, weight, EPS)
    for out, res in zip(outs, residuals):
        assert torch.equal(res, want_res)
        torch.testing.assert_close(out, want_out, rtol=0, atol=2e-6)


def test_bad_operands_raise() -> None:
    x = torch.zeros(2, HIDDEN)
    ptrs = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="residual"):
        all_reduce_add_rmsnorm(x, torch.zeros(3, HIDDEN), torch.ones(HIDDEN), EPS, ptrs, ptrs, 0, 2)
    with pytest.raises(ValueError, match="weight"):
        all_reduce_add_rmsnorm(x, None, torch.ones(HIDDEN + 1), EPS, ptrs, ptrs, 0, 2)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        all_reduce_add_rmsnorm(x, None, torch.ones(HIDDEN), EPS, ptrs, ptrs, 2, 2)
    assert all_reduce_add_rmsnorm(x[:0], None, torch.ones(HIDDEN), EPS, ptrs, ptrs, 0, 2).shape == (0, HIDDEN)
