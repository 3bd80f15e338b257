"""CPU side of the symmetric-memory all-reduce: a single rank never builds one, a CPU device never does
(the ranks agree on None and keep gloo), and a Ray actor finds its CUDA index whether Ray narrowed
CUDA_VISIBLE_DEVICES or left every GPU visible."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch

from runtime.cluster.tp_rank import local_gpu_index
from runtime.distributed import ParallelGroup
from runtime.models.parallel_context import ParallelContext


def test_single_rank_keeps_the_plain_group():
    g = ParallelGroup.single()
    assert g.with_fast_all_reduce(torch.bfloat16, torch.device("cpu"), 1 << 20) is g
    ctx = ParallelContext().with_fast_all_reduce(torch.bfloat16, torch.device("cpu"), 8, 64)
    assert ctx.attn.fast is None and ctx.mlp.fast is None
    x = torch.ones(3)
    assert g.all_reduce(x) is x
    assert g.all_reduce_kind == "none"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    g = ParallelGroup(rank, 2, dist.group.WORLD)
    ctx = ParallelContext.tensor_parallel(g).with_fast_all_reduce(torch.float32, torch.device("cpu"), 8, 16)
    x = torch.full((4,), float(rank + 1))
    results.put((rank, ctx.mlp.fast is None, ctx.attn is ctx.mlp, ctx.mlp.all_reduce(x).tolist(),
                 ctx.mlp.all_reduce_kind))
    dist.destroy_process_group()


def test_cpu_ranks_agree_on_no_fast_path_and_still_reduce():
    import torch.multiprocessing as mp

    mpctx = mp.get_context("spawn")
    q = mpctx.Queue()
    port = _free_port()
    procs = [mpctx.Process(target=_cpu_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == [(0, True, True, [3.0] * 4, "gloo"), (1, True, True, [3.0] * 4, "gloo")]


@pytest.mark.parametrize(("gpu_id", "visible", "index"), [
    ("3", "3", 0),          # Ray narrowed the actor to its GPU
    ("3", None, 3),         # every GPU visible, none hidden before Ray started
    ("3", "1,3,5", 1),      # every GPU Ray was given visible: the id's place in the list
    ("5", " 1, 5", 1),
])
def test_local_gpu_index(gpu_id, visible, index):
    assert local_gpu_index(gpu_id, visible) == index


def test_local_gpu_index_rejects_a_gpu_it_cannot_see():
    with pytest.raises(RuntimeError, match="does not list"):
        local_gpu_index("2", "0,1")
