"""Latency of one small all-reduce (a decode step's [batch, hidden] bf16 activations) between N GPUs, per
implementation, inside a CUDA graph (64 calls per graph, as a 32-layer decode graph holds) and eagerly:

  nccl        torch.distributed.all_reduce (what ParallelGroup uses)
  symm_1shot  torch symmetric memory: copy into the shared buffer, one_shot_all_reduce (each rank reads
              every peer's buffer over NVLink and sums)
  symm_2shot  torch symmetric memory two_shot_all_reduce_ (reduce-scatter + all-gather through peers)

Each result is checked against the exact sum. `--narrow` gives each process only its own GPU in
CUDA_VISIBLE_DEVICES, as Ray does for a num_gpus=1 actor, to see which paths still work there.

    python benchmarks/bench_allreduce.py --world 2 --out benchmarks/results/allreduce_2gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import print_table, write_result  # noqa: E402

MODES = ("nccl", "symm_1shot", "symm_2shot")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 256])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--narrow", action="store_true")
    p.add_argument("--out", default="benchmarks/results/allreduce_2gpu.json")
    return p.parse_args(argv)


def make_op(mode: str, numel_max: int, device) -> Any:
    import torch
    import torch.distributed as dist

    if mode == "nccl":
        def op(x):
            dist.all_reduce(x)
            return x
        return op
    import torch.distributed._symmetric_memory as symm_mem

    name = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(name)
    buf = symm_mem.empty(numel_max, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buf, name)

    if mode == "symm_1shot":
        def op(x):
            n = x.numel()
            buf[:n].copy_(x.view(-1))
            return torch.ops.symm_mem.one_shot_all_reduce(buf[:n], "sum", name).view(x.shape)
        return op

    def op(x):
        n = x.numel()
        buf[:n].copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(buf[:n], "sum", name)
        return buf[:n].view(x.shape).clone()
    return op


def time_op(op, x, expected) -> dict[str, Any]:
    import torch

    got = op(x.clone())
    torch.cuda.synchronize()
    err = (got.float() - expected).abs().max().item()
    return time_eager_and_graph(op, x) | {"max_abs_err": err}


def time_eager_and_graph(op, x) -> dict[str, float]:
    """Per-call µs of op(x): 100 eager calls, and 64 calls captured in one CUDA graph (as a 32-layer
    decode graph holds), replayed 20 times. The first call runs outside capture (NCCL needs that)."""
    import torch

    for _ in range(10):
        op(x.clone())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        op(x)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) / 100
    g, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    y = x.clone()
    with torch.cuda.stream(stream):
        op(y)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(64):
                op(y)
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    return {"graph_us": 1e6 * (time.perf_counter() - t0) / (20 * 64), "eager_us": 1e6 * eager}


def rank_main(rank: int, ns: argparse.Namespace, port: int, out: Any) -> None:
    if ns.narrow:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import torch
    import torch.distributed as dist

    local = 0 if ns.narrow else rank
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ns.world,
                            timeout=datetime.timedelta(seconds=60), device_id=device)
    res: dict[str, Any] = {}
    for mode in ns.modes:
        try:
            op = make_op(mode, max(ns.batch) * ns.hidden, device)
        except Exception as e:  # a path this machine cannot take is a result, not a crash
            res[mode] = {"error": f"{type(e).__name__}: {e}"[:300]}
            if rank == 0:
                traceback.print_exc()
            continue
        for bs in ns.batch:
            # rank r holds (r + 1) * base, so the sum is base * world * (world + 1) / 2
            base = torch.randint(-8, 8, (bs, ns.hidden), generator=torch.Generator().manual_seed(bs)).to(device)
            x = (base * (rank + 1)).to(torch.bfloat16)
            expected = (base * ns.world * (ns.world + 1) // 2).float()
            try:
                res[f"{mode}_bs{bs}"] = time_op(op, x, expected)
            except Exception as e:
                res[f"{mode}_bs{bs}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        dist.barrier()
    if rank == 0:
        out.put(res)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=rank_main, args=(r, ns, port, q)) for r in range(ns.world)]
    for p in procs:
        p.start()
    results = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    rows = [(f"{k} {m}", v) for k, r in results.items() for m, v in r.items()]
    print_table(f"all-reduce of [batch, {ns.hidden}] bf16 over {ns.world} GPUs (rank 0)", rows)
    print(f"wrote {write_result(ns.out, 'allreduce', results, vars(ns), argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
