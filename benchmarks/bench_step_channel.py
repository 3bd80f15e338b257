"""StepChannel latency: rank 0 broadcasts a WorkerBatch-sized message, rank 1 answers on a second
channel; half the round trip is what a TP follower waits, per step, before it can launch.

    python benchmarks/bench_step_channel.py --sizes 600 6000 --iters 2000
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _worker(rank: int, port: int, sizes: list[int], iters: int, out: dict) -> None:
    import torch
    import torch.distributed as dist

    from runtime.distributed.step_channel import StepChannel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    forward = StepChannel.create(rank)
    reply = torch.zeros(1, dtype=torch.int64)
    for size in sizes:
        msg = b"x" * size
        t0 = time.perf_counter()
        for _ in range(iters):
            if rank == 0:
                forward.send(msg)
                dist.recv(reply, src=1)
            else:
                forward.recv()
                dist.send(reply, dst=0)
        if rank == 0:
            out[size] = 1e6 * (time.perf_counter() - t0) / iters / 2
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[600, 6000])
    p.add_argument("--iters", type=int, default=2000)
    ns = p.parse_args(argv)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(port, ns.sizes, ns.iters, out), nprocs=2)
    for size in ns.sizes:
        print(f"StepChannel one-way latency, {size} B: {out[size]:.1f} us (cores: {os.cpu_count()}, "
              f"load {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
