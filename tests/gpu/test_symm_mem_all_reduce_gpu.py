"""The symmetric-memory all-reduce inside a CUDA graph: 64 back-to-back calls on one shared buffer (as a
32-layer decode graph makes) each give the exact sum on every rank, replay after replay, with the inputs
changed between replays, with the staging copy separate or fused into the kernel (one_shot_all_reduce_copy);
outside capture the same ParallelGroup falls back to NCCL."""

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

CALLS, ROWS, HIDDEN = 64, 8, 4096


def _rank(rank: int, world: int, port: int, dtype: torch.dtype, errors, fused_copy: bool = False) -> None:
    import torch.distributed as dist

    from runtime.distributed import ParallelGroup

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60), device_id=device)
    try:
        group = ParallelGroup(rank, world, dist.group.WORLD).with_fast_all_reduce(dtype, device, ROWS * HIDDEN * 4)
        assert group.fast is not None, "symmetric memory unavailable on a single-node 2-GPU machine"
        group.fast.fused_copy = fused_copy
        inputs = torch.empty(CALLS, ROWS, HIDDEN, dtype=dtype, device=device)
        outs: list[torch.Tensor] = []
        g, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            group.all_reduce(inputs[0].clone())
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=stream):
                outs = [group.all_reduce(inputs[k] * 1) for k in range(CALLS)]
        torch.cuda.synchronize()
        for replay in range(3):
            gen = torch.Generator().manual_seed(replay)
            base = torch.randint(-64, 64, (CALLS, ROWS, HIDDEN), generator=gen)
            inputs.copy_(base * (rank + 1))
            g.replay()
            torch.cuda.synchronize()
            want = (base * (world * (world + 1) // 2)).to(dtype)
            for k in range(CALLS):
                assert torch.equal(outs[k].cpu(), want[k]), f"replay {replay} call {k}"
        eager = inputs[0].clone()
        assert group.all_reduce(eager) is eager  # not capturing: NCCL in place
    except BaseException as e:
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fused_copy", [False, True], ids=["staged", "fused-copy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_symm_mem_all_reduce_in_cuda_graph_is_exact(dtype, fused_copy):
    if fused_copy and not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        pytest.skip(f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = 29000 + os.getpid() % 1000 + (dtype == torch.float32) + 2 * fused_copy
    procs = [ctx.Process(target=_rank, args=(r, 2, port, dtype, errors, fused_copy)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    found = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not found, found
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
