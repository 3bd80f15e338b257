"""The fused one-shot all-reduce + residual add + RMSNorm on 2 GPUs over torch symmetric memory: inside a
CUDA graph of 32 back-to-back calls (a 32-layer decode step's post-attention norms), replayed with new
inputs, every rank's output and residual equal NCCL's all-reduce followed by fused_add_rmsnorm bit for bit
over three replays (the epoch flags carry on from one replay to the next; counters out of step would spin
until the join timeout), and the flag counters end where one epoch per call puts them. "mixed" changes the
row count from call to call (1, 200, 32, 129, ...): the single-barrier protocol relies on each row
belonging to the same program whatever the count, and on the two buffer halves alternating per program."""

from __future__ import annotations

import datetime
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs 2 CUDA GPUs for a symmetric-memory all-reduce; this machine has "
                              f"{torch.cuda.device_count()}"),
]

CALLS, HIDDEN, EPS = 32, 4096, 1e-5


MIXED = (1, 200, 32, 129, 3, 128)


def _rank(rank: int, world: int, port: int, rows_arg: int | str, errors) -> None:
    import torch.distributed as dist

    from kernels.rmsnorm import fused_add_rmsnorm
    from runtime.distributed import ParallelGroup

    os.environ["SHOAL_FUSED_AR_NORM"] = "1"  # the default, whatever the caller's environment says
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60), device_id=device)
    try:
        per_call = [MIXED[k % len(MIXED)] for k in range(CALLS)] if rows_arg == "mixed" else [int(rows_arg)] * CALLS
        rows = max(per_call)
        dtype = torch.bfloat16
        group = ParallelGroup(rank, world, dist.group.WORLD).with_fast_all_reduce(dtype, device, rows * HIDDEN * 2)
        fast = group.fast
        assert fast is not None and fast.buffer_ptrs is not None, "symmetric memory unavailable on 2 GPUs"
        xs = torch.empty(CALLS, rows, HIDDEN, dtype=dtype, device=device)
        res = torch.empty(CALLS, rows, HIDDEN, dtype=dtype, device=device)
        weight = (1 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(7))).to(dtype).to(device)
        g, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fast.add_rmsnorm(xs[0, :rows].clone(), res[0, :rows].clone(), weight, EPS)  # warm-up compile, eagerly
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=stream):
                assert fast.can_add_rmsnorm(xs[0])
                outs = [fast.add_rmsnorm(xs[k, :n], res[k, :n], weight, EPS) for k, n in enumerate(per_call)]
        torch.cuda.synchronize()
        for replay in range(3):
            gen = torch.Generator().manual_seed(100 * replay + rank)
            x_host = torch.randn(CALLS, rows, HIDDEN, generator=gen).to(dtype)
            r_host = torch.randn(CALLS, rows, HIDDEN, generator=torch.Generator().manual_seed(replay)).to(dtype)
            xs.copy_(x_host)
            res.copy_(r_host)
            g.replay()
            torch.cuda.synchronize()
            for k, n in enumerate(per_call):
                want = x_host[k, :n].to(device)
                dist.all_reduce(want)
                want_res = r_host[k, :n].to(device)
                fused_add_rmsnorm(want, want_res, weight, EPS)
                assert torch.equal(res[k, :n], want_res), f"replay {replay} call {k}: residual"
                assert torch.equal(outs[k], want), f"replay {replay} call {k}: output"
        from kernels.all_reduce_rmsnorm import MAX_PROGRAMS

        epochs = fast.flags[MAX_PROGRAMS * world:].cpu()
        # One epoch per call a program took part in: the warm-up, then 3 replays of its calls in the graph.
        want = [int(p < min(rows, MAX_PROGRAMS)) + 3 * sum(1 for n in per_call if p < min(n, MAX_PROGRAMS))
                for p in range(MAX_PROGRAMS)]
        assert epochs.tolist() == want, epochs.tolist()
    except BaseException as e:
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rows", [1, 32, 200, "mixed"])
def test_fused_all_reduce_rmsnorm_equals_nccl_then_norm(rows: int | str) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = 29500 + os.getpid() % 1000 + (rows if isinstance(rows, int) else 50) % 97
    procs = [ctx.Process(target=_rank, args=(r, 2, port, rows, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    found = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not found, found
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
