"""StepChannel kinds side by side (shm ring vs gloo broadcast), two processes on this machine: what a TP
follower waits, per step, between rank 0's send and having the bytes, and what an idle follower costs.

Rank 0 sends WorkerBatch-sized messages paced `--gap-ms` apart (the follower is already waiting, as in a
decode loop; rank 0 sleeps between sends, it does not spin); rank 1 takes each one's one-way latency from the send time in the frame (one monotonic
clock per node). A gap longer than the shm reader's spin (2 ms) measures its futex wake-up instead.
Idle: rank 1 waits --idle-s for a message that comes only then; its CPU time over that wait is the
follower's idle cost (issue 13 item 6: at most 5% of a core).

    python benchmarks/bench_step_channel.py --out benchmarks/results/step_channel_cpu.json
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
sys.path.insert(0, str(ROOT / "benchmarks"))


def _worker(rank: int, port: int, ns: argparse.Namespace, out: dict) -> None:
    import torch.distributed as dist

    from runtime.distributed.step_channel import create_step_channel

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for kind in ns.kinds:
        ch = create_step_channel(rank, 2, kind.split("-")[0], spin_s=0.0 if kind.endswith("-nospin") else 0.002)
        for size in ns.sizes:
            for gap_ms in ns.gap_ms:
                msg = b"x" * size
                dist.barrier()
                lat = []
                for i in range(ns.iters + 20):
                    if rank == 0:
                        time.sleep(gap_ms / 1e3)  # sleeping, not spinning: this VM's 2 cores are shared
                        ch.send(msg, (i,))
                    else:
                        f = ch.recv()
                        if i >= 20:
                            lat.append((time.monotonic_ns() - f.sent_ns) / 1e3)
                if rank == 1:
                    lat.sort()
                    out[f"{kind}_{size}B_gap{gap_ms}ms"] = {
                        "median_us": lat[len(lat) // 2], "p90_us": lat[int(0.9 * (len(lat) - 1))],
                        "mean_us": sum(lat) / len(lat), "n": len(lat)}
        dist.barrier()
        if rank == 0:
            time.sleep(ns.idle_s)
            ch.send(b"wake")
        else:
            t0, c0 = time.perf_counter(), time.process_time()
            ch.recv()
            out[f"{kind}_idle_cpu_share"] = (time.process_time() - c0) / (time.perf_counter() - t0)
        dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=["shm", "shm-nospin", "gloo"],
                   help="shm-nospin: the shm reader sleeps at once (what CPU ranks use)")
    p.add_argument("--sizes", type=int, nargs="+", default=[600, 6000, 120000])
    p.add_argument("--gap-ms", type=float, nargs="+", default=[1.0, 5.0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(port, ns, out), nprocs=2)
    results = dict(out) | {"cores": os.cpu_count(), "load_1min": os.getloadavg()[0]}
    for k, v in results.items():
        print(f"{k}: {v}")
    if ns.out:
        from common import write_result

        print(f"wrote {write_result(ns.out, 'step_channel', results, vars(ns), argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
