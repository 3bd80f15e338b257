"""Where a decode step's time goes on the GPU: CPU time inside launch_batch (should not wait for the
device), time waiting in finish_batch, and host-sync calls seen by the torch profiler.

    python -m benchmarks.profile_step --model-config Llama-3.1-8B-Instruct --batch 256
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import make_model_folder  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--attention-backend", default="auto")
    a = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from runtime import Engine

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model_folder(a.model_config, Path(tmp) / "m")
        for bs in a.batch:
            e = Engine(str(folder), load_format="dummy", dtype="bfloat16", cuda_graph_max_bs=max(a.batch),
                       max_running_requests=max(bs, 8), attention_backend=a.attention_backend, log_interval_s=1e9)
            w = e.worker
            times = {"launch": [], "finish": []}
            launch, finish = w.launch_batch, w.finish_batch

            def timed_launch(b, launch=launch, times=times):
                t = time.perf_counter()
                r = launch(b)
                times["launch"].append(time.perf_counter() - t)
                return r

            def timed_finish(h, finish=finish, times=times):
                t = time.perf_counter()
                r = finish(h)
                times["finish"].append(time.perf_counter() - t)
                return r

            w.launch_batch, w.finish_batch = timed_launch, timed_finish
            prompts = [[1000 + (i * 7 + j) % 20000 for j in range(128)] for i in range(bs)]
            e.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
            for k in times:
                times[k].clear()
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                e.generate(input_ids=prompts, sampling_params={"max_new_tokens": 64, "temperature": 0,
                                                               "ignore_eos": True})
            wall = time.perf_counter() - t0
            n = len(times["launch"])
            print(f"batch {bs}: {n} launches, {1e3 * wall / max(n, 1):.2f} ms/step wall, "
                  f"launch {1e3 * sum(times['launch']) / n:.2f} ms, finish wait {1e3 * sum(times['finish']) / n:.2f} ms")
            rows = [ev for ev in prof.key_averages() if any(s in ev.key for s in (
                "Synchronize", "item", "_local_scalar_dense", "cudaMemcpy", "tolist", "pin_memory", "nonzero"))]
            for ev in sorted(rows, key=lambda ev: -ev.cpu_time_total)[:12]:
                print(f"   {ev.key:50s} calls {ev.count:6d}  cpu total {ev.cpu_time_total / 1e3:9.2f} ms")
            e.shutdown()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
