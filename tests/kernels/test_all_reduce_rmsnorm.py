"""The fused one-shot all-reduce + residual add + RMSNorm (kernels/all_reduce_rmsnorm.py) in the Triton
interpreter: the ranks of a group run one after another in this process over ordinary CPU tensors standing
in for the symmetric buffers, each rank's peers that have not run yet "already arrived" (their rows copied
into their buffers, their epochs written in its flag area). Checks every rank's output and residual against
the reference (fp32 and fp16: the interpreter's bf16 rounding differs from torch's at ties; bf16 runs on 2
GPUs, tests/gpu/test_all_reduce_rmsnorm_gpu.py) and the protocol over several calls (a graph replayed):
each program's counter advances by one a call, every peer's arrival slot holds its last epoch, and call c
stages its rows in buffer half c % 2 (a peer's rows are placed only in that half, so reading the other
would give wrong sums). The real cross-GPU ordering is only exercised on GPUs."""

from __future__ import annotations

import pytest
import torch

from kernels.all_reduce_rmsnorm import (
    all_reduce_add_rmsnorm,
    all_reduce_add_rmsnorm_ref,
    flag_slots,
    num_programs,
)

HIDDEN, EPS = 48, 1e-5


def _simulate(world: int, rows: int, dtype: torch.dtype, with_residual: bool, seed: int = 0, calls: int = 1):
    gen = torch.Generator().manual_seed(seed)
    partials = [torch.randn(rows, HIDDEN, generator=gen).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, HIDDEN, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    half = rows * HIDDEN + 16
    bufs = [torch.zeros(2 * half, dtype=dtype) for _ in range(world)]
    flags = [torch.zeros(flag_slots(world), dtype=torch.int64) for _ in range(world)]
    buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    progs = num_programs(rows)
    for call in range(calls):
        outs, residuals = [], []
        for rank in range(world):
            for later in range(rank + 1, world):  # peers yet to run: arrived, rows in this call's half
                part = bufs[later][(call % 2) * half:]
                part[: rows * HIDDEN].copy_(partials[later].reshape(-1))
                bufs[later][(1 - call % 2) * half:][: rows * HIDDEN].fill_(float("nan"))  # never read
                _arrivals(flags[rank], world)[:progs, later] = call + 1
            res = residual.clone() if residual is not None else None
            outs.append(all_reduce_add_rmsnorm(partials[rank].clone(), res, weight, EPS, buf_ptrs, flag_ptrs,
                                               rank, world, half))
            residuals.append(res)
    return partials, residual, weight, outs, residuals, flags, progs


def _arrivals(flags: torch.Tensor, world: int) -> torch.Tensor:
    from kernels import all_reduce_rmsnorm

    return flags[: all_reduce_rmsnorm.MAX_PROGRAMS * world].view(-1, world)


def _epochs(flags: torch.Tensor, world: int) -> torch.Tensor:
    from kernels import all_reduce_rmsnorm

    return flags[all_reduce_rmsnorm.MAX_PROGRAMS * world:]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_rank_gets_the_reference(world: int, rows: int, dtype: torch.dtype) -> None:
    partials, residual, weight, outs, residuals, flags, progs = _simulate(world, rows, dtype, True)
    want_out, want_res = all_reduce_add_rmsnorm_ref(partials, residual, weight, EPS)
    for rank in range(world):
        assert torch.equal(residuals[rank], want_res), f"rank {rank} residual"
        torch.testing.assert_close(outs[rank], want_out, rtol=0, atol=2e-6 if dtype == torch.float32 else 1e-3)
        assert torch.equal(outs[rank], outs[0])  # the ranks agree bit for bit
    # Each program's counter moved by one (its one barrier); every peer's arrival slot holds that epoch,
    # its own slot nothing; programs that did not run left theirs at zero.
    for rank in range(world):
        assert _epochs(flags[rank], world)[:progs].tolist() == [1] * progs
        assert int(_epochs(flags[rank], world)[progs:].abs().sum()) == 0
        grid = _arrivals(flags[rank], world)
        for peer in range(world):
            assert grid[:progs, peer].tolist() == [0 if peer == rank else 1] * progs, (rank, peer)
        assert int(grid[progs:].abs().sum()) == 0


@pytest.mark.parametrize("calls", [2, 3])
def test_later_calls_use_the_next_epochs_and_alternate_halves(calls: int) -> None:
    """A replayed graph: the same flag areas, the counters carry on (one a call), each call reads the half
    its parity names (the other holds NaN), outputs unchanged."""
    partials, residual, weight, outs, residuals, flags, progs = _simulate(2, 3, torch.float32, True, calls=calls)
    want_out, want_res = all_reduce_add_rmsnorm_ref(partials, residual, weight, EPS)
    for rank in range(2):
        assert torch.equal(residuals[rank], want_res)
        torch.testing.assert_close(outs[rank], want_out, rtol=0, atol=2e-6)
        assert _epochs(flags[rank], 2)[:progs].tolist() == [calls] * progs
        assert _arrivals(flags[rank], 2)[:progs, 1 - rank].tolist() == [calls] * progs


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
        all_reduce_add_rmsnorm(x, torch.zeros(3, HIDDEN), torch.ones(HIDDEN), EPS, ptrs, ptrs, 0, 2, 1024)
    with pytest.raises(ValueError, match="weight"):
        all_reduce_add_rmsnorm(x, None, torch.ones(HIDDEN + 1), EPS, ptrs, ptrs, 0, 2, 1024)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        all_reduce_add_rmsnorm(x, None, torch.ones(HIDDEN), EPS, ptrs, ptrs, 2, 2, 1024)
    with pytest.raises(ValueError, match="buffer half of 95"):
        all_reduce_add_rmsnorm(x, None, torch.ones(HIDDEN), EPS, ptrs, ptrs, 0, 2, 2 * HIDDEN - 1)
    assert all_reduce_add_rmsnorm(x[:0], None, torch.ones(HIDDEN), EPS, ptrs, ptrs, 0, 2, 1024).shape == (0, HIDDEN)
