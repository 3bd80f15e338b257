"""CPU cost of one scheduler step (batch building, KV allocation, result processing, output delivery)
with a worker that does no model work, so the number is pure scheduling overhead per decode step.

    python -m benchmarks.bench_scheduler_overhead --batch 256 --steps 200
"""

from __future__ import annotations

import argparse
import time

from runtime.config import ServerArgs
from runtime.managers.scheduler import Scheduler
from runtime.messages import BatchResult, GenerateRequest, WorkerBatch
from runtime.sampling.params import SamplingParams


class NullWorker:
    """Returns token 7 for every request; costs nothing."""

    def run_batch(self, batch: WorkerBatch) -> BatchResult:
        return BatchResult(batch_id=batch.batch_id, next_token_ids=[7] * len(batch.req_pool_indices))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args(argv)
    args = ServerArgs(device="cpu", max_running_requests=a.batch, log_interval_s=1e9)
    delivered = [0]
    sched = Scheduler(args, NullWorker(), max_total_tokens=a.batch * (a.input_len + a.steps + 8),
                      max_reqs=a.batch + 4, context_len=a.input_len + a.steps + 16, vocab_size=32000,
                      eos_token_ids=frozenset({2}), sink=lambda outs: delivered.__setitem__(0, delivered[0] + len(outs)))
    params = SamplingParams(max_new_tokens=a.steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(a.batch):
        sched.submit(GenerateRequest(rid=str(i), input_ids=[(i * 31 + j) % 31999 + 1 for j in range(a.input_len)],
                                     sampling_params=params))
    while len(sched.running) < a.batch:  # prefill everything first
        sched.step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        sched.step()
    per_step_ms = (time.perf_counter() - t0) / a.steps * 1e3
    print(f"decode batch {a.batch}: {per_step_ms:.3f} ms of scheduler CPU per step ({delivered[0]} deltas)")
    return {"batch": a.batch, "per_step_ms": per_step_ms}


if __name__ == "__main__":
    main()
