"""Per-step dispatch overhead of the scheduler → TP-worker path under Ray, with a no-op-ish worker.

Each step sends one WorkerBatch (a decode batch of --batch-size requests) to every TP rank and waits for
rank 0's BatchResult, through runtime/cluster/worker_group.py's WorkerGroup itself. Paths compared:
  struct    baseline: the WorkerBatch Struct pickled into each rank's actor call, every rank answering
  actor     WorkerGroup dispatch="actor": msgpack-encoded once, one actor call per rank, rank 0 answers
  compiled  WorkerGroup dispatch="compiled": a Ray compiled graph (ray.dag) over shared-memory channels
The worker returns at once (work 0) or sleeps --work-ms (a stand-in for the forward, which shows how each
path behaves when the caller waits rather than spins). overhead = step wall time − work. It also reports
the CPU seconds each idle worker burns per second (compiled-graph channels busy-poll).

    python benchmarks/bench_dispatch.py --tp 2 --steps 300 --out benchmarks/results/dispatch_cpu.json
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgspec  # noqa: E402
from common import print_table, summarize, write_result  # noqa: E402

from runtime.cluster.worker_group import WorkerGroup  # noqa: E402
from runtime.messages import BatchResult, SamplingBatch, WorkerBatch  # noqa: E402
from runtime.model_executor.forward_mode import ForwardMode  # noqa: E402


class NoopWorker:
    """Stands in for TpWorkerActor (same bytes in, bytes out from rank 0), with no model."""

    def __init__(self, rank: int, work_s: float):
        self.rank, self.work_s = rank, work_s
        self.decoder = msgspec.msgpack.Decoder(WorkerBatch)
        self.encoder = msgspec.msgpack.Encoder()

    def _result(self, batch: WorkerBatch) -> BatchResult:
        if self.work_s:
            time.sleep(self.work_s)
        return BatchResult(batch_id=batch.batch_id, next_token_ids=[t + 1 for t in batch.input_ids])

    def run_batch(self, data: bytes) -> bytes:
        result = self._result(self.decoder.decode(data))
        return self.encoder.encode(result) if self.rank == 0 else b""

    def run_struct(self, batch: WorkerBatch) -> BatchResult:
        return self._result(batch)

    def ping(self) -> bool:
        return True

    def cpu_seconds(self) -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime


def make_batch(step: int, bs: int) -> WorkerBatch:
    n = bs
    sampling = SamplingBatch(
        temperatures=[0.0] * n, top_ps=[1.0] * n, top_ks=[-1] * n, min_ps=[0.0] * n, seeds=list(range(n)),
        steps=[step] * n, repetition_penalties=[1.0] * n, frequency_penalties=[0.0] * n,
        presence_penalties=[0.0] * n, penalty_tokens=[[] for _ in range(n)], prompt_lens=[128] * n,
        blocked_token_ids=[[] for _ in range(n)], top_logprobs_nums=[0] * n)
    return WorkerBatch(batch_id=step, forward_mode=int(ForwardMode.DECODE), input_ids=list(range(n)),
                       req_pool_indices=list(range(n)), seq_lens=[128 + step] * n, prefix_lens=[127 + step] * n,
                       out_cache_loc=list(range(n)), sampling=sampling)


def time_steps(call, steps: int, bs: int) -> list[float]:
    """Runs `call(batch)` steps times on a background thread (the scheduler's thread runs it in Shoal)."""
    samples: list[float] = []

    def body() -> None:
        for i in range(steps):
            b = make_batch(i, bs)
            t0 = time.perf_counter()
            call(b)
            samples.append(time.perf_counter() - t0)

    th = threading.Thread(target=body)
    th.start()
    th.join()
    return samples


def idle_cpu(workers: list, seconds: float = 2.0) -> float:
    """CPU seconds per second an idle worker burns (mean over workers)."""
    import ray

    before = ray.get([w.cpu_seconds.remote() for w in workers])
    time.sleep(seconds)
    after = ray.get([w.cpu_seconds.remote() for w in workers])
    return sum(a - b for a, b in zip(after, before)) / len(workers) / seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--work-ms", type=float, nargs="*", default=[0.0, 5.0])
    p.add_argument("--num-cpus", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/dispatch_cpu.json")
    ns = p.parse_args(argv)

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    ray.init(address="local", num_cpus=ns.num_cpus or max(os.cpu_count() or 1, ns.tp), include_dashboard=False,
             object_store_memory=256 << 20, log_to_driver=False)
    results: dict[str, dict] = {}
    remote_worker = ray.remote(num_cpus=1)(NoopWorker)
    for work_ms in ns.work_ms:
        for path in ("struct", "actor", "compiled"):
            workers = [remote_worker.remote(r, work_ms / 1e3) for r in range(ns.tp)]
            ray.get([w.ping.remote() for w in workers])
            if path == "struct":
                def call(b: WorkerBatch, workers=workers) -> BatchResult:
                    return ray.get([w.run_struct.remote(b) for w in workers])[0]
                group = None
            else:
                group = WorkerGroup(workers, dispatch=path, name=f"bench-{path}")
                call = group.run_batch
            time_steps(call, 20, ns.batch_size)  # warm up (and compile the graph)
            wall = time_steps(call, ns.steps, ns.batch_size)
            entry = {"path": path, "work_ms": work_ms, "tp": ns.tp, "step_us": summarize(wall, 1e6),
                     "overhead_us": summarize([w - work_ms / 1e3 for w in wall], 1e6)}
            if work_ms == 0:
                entry["idle_worker_cpu_per_s"] = idle_cpu(workers)
            results[f"{path}_work{work_ms:g}ms"] = entry
            if group is not None:
                group.kill()
            else:
                for w in workers:
                    ray.kill(w)
    ray.shutdown()
    rows = [(f"{k} overhead p50 / mean", f"{v['overhead_us']['p50']:.0f} / {v['overhead_us']['mean']:.0f} µs")
            for k, v in results.items()]
    rows += [(f"{k} idle worker CPU", f"{v['idle_worker_cpu_per_s']:.2f} s/s")
             for k, v in results.items() if "idle_worker_cpu_per_s" in v]
    print_table("dispatch overhead per step", rows)
    out = write_result(ns.out, "dispatch", results, vars(ns), argv)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
