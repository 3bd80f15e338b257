"""Where a TP decode step's time goes, without Ray: N processes (torch.multiprocessing, one GPU each, one
NCCL group) each drive a ModelRunner directly with hand-built decode WorkerBatches.

Per TP size it reports, on rank 0:
  step_ms         wall time of run_batch (launch + finish: graph replay, sampling, the token copy back)
  device_ms       the step's CUDA-event time (what BatchResult.device_s reports to the scheduler)
  allreduce_us    one ParallelGroup all-reduce of the step's [batch, hidden] activations, eager (NCCL) and
                  inside a CUDA graph (64 in one graph, as a 32-layer decode graph holds), per call
TP > 1 runs once per --variants entry: `custom` (serving's default: the runner gives its groups the
symmetric-memory one-shot all-reduce for graph-captured all-reduces, fused with the residual add and
RMSNorm unless SHOAL_FUSED_AR_NORM=0) and `nccl` (--disable-custom-all-reduce).
Ray's own cost is then bench_tp's Ray step minus this step_ms. --profile-steps N adds, per batch size, a
torch.profiler trace of N decode steps on rank 0 cut at the graph replays and classified by kernel name
(benchmarks/trace_breakdown.py: gemm, attention, norm, all_reduce, ... and the gaps between them).

    python benchmarks/bench_tp_step.py --tp-sizes 1 2 --batch 1 --out benchmarks/results/tp_step_2gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import make_model_folder, print_table, write_result  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--variants", nargs="+", default=["custom", "nccl"], choices=["custom", "nccl"])
    p.add_argument("--profile-steps", type=int, default=0,
                   help="rank 0 also traces this many decode steps per batch size (trace_breakdown categories)")
    p.add_argument("--out", default="benchmarks/results/tp_step_2gpu.json")
    return p.parse_args(argv)


def greedy(n: int):
    from runtime.messages import SamplingBatch

    return SamplingBatch(temperatures=[0.0] * n, top_ps=[1.0] * n, top_ks=[-1] * n, min_ps=[0.0] * n,
                         seeds=[0] * n, steps=[0] * n, repetition_penalties=[1.0] * n,
                         frequency_penalties=[0.0] * n, presence_penalties=[0.0] * n, penalty_tokens=[[]] * n,
                         prompt_lens=[0] * n, blocked_token_ids=[[]] * n, top_logprobs_nums=[0] * n)


def time_decode(runner, bs: int, ns: argparse.Namespace, trace: bool = False) -> dict[str, Any]:
    from runtime.messages import WorkerBatch
    from runtime.model_executor.forward_mode import ForwardMode

    rows = list(range(bs))
    next_slot = 0

    def slots(n: int) -> list[int]:
        nonlocal next_slot
        next_slot += n
        return list(range(next_slot - n, next_slot))

    vocab = runner.model_config.vocab_size
    prompt = [(1000 + i * 37) % vocab for i in range(ns.input_len)]
    seq = [ns.input_len] * bs
    wb = WorkerBatch(batch_id=0, forward_mode=int(ForwardMode.EXTEND), input_ids=prompt * bs, req_pool_indices=rows,
                     seq_lens=seq, prefix_lens=[0] * bs, out_cache_loc=slots(ns.input_len * bs), sampling=greedy(bs))
    ids = runner.run_batch(wb).next_token_ids
    walls, devs = [], []

    def decode() -> Any:
        nonlocal seq, ids
        seq = [s + 1 for s in seq]
        wb = WorkerBatch(batch_id=len(walls) + 1, forward_mode=int(ForwardMode.DECODE), input_ids=ids,
                         req_pool_indices=rows, seq_lens=seq, prefix_lens=[s - 1 for s in seq],
                         out_cache_loc=slots(bs), sampling=greedy(bs))
        res = runner.run_batch(wb)
        ids = res.next_token_ids
        return res

    for _ in range(ns.steps + 10):  # the first 10 warm up
        t0 = time.perf_counter()
        res = decode()
        walls.append(time.perf_counter() - t0)
        devs.append(res.device_s)
    walls, devs = sorted(walls[10:]), sorted(devs[10:])
    out: dict[str, Any] = {"step_ms": 1000 * walls[len(walls) // 2], "device_ms": 1000 * devs[len(devs) // 2]}
    extra = ns.profile_steps + 3 if ns.profile_steps else 0  # every rank runs them: collectives stay in step
    if trace:
        out["profile"] = _trace(lambda: [decode() for _ in range(extra)], ns.profile_steps)
    else:
        for _ in range(extra):
            decode()
    return out


def _trace(work: Any, steps: int) -> dict[str, Any]:
    """A CUPTI trace of `work` cut into its graph replays (all ranks run the same steps; rank 0 is traced)."""
    import json

    from torch.profiler import ProfilerActivity, profile
    from trace_breakdown import breakdown

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        work()
    with tempfile.TemporaryDirectory(prefix="shoal-tp-trace-") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return breakdown(events, steps=steps, drop_last=2).as_dict()


def time_allreduce(group, bs: int, hidden: int, device) -> dict[str, float]:
    import torch
    from bench_allreduce import time_eager_and_graph

    t = time_eager_and_graph(group.all_reduce, torch.randn(bs, hidden, dtype=torch.bfloat16, device=device))
    return {"allreduce_eager_us": t["eager_us"], "allreduce_graph_us": t["graph_us"]}


def rank_main(rank: int, tp: int, variant: str, port: int, folder: str, ns: argparse.Namespace, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from runtime.config import ServerArgs
    from runtime.distributed import ParallelGroup
    from runtime.model_executor.model_runner import ModelRunner
    from runtime.models.parallel_context import ParallelContext

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = ParallelGroup.single()
    if tp > 1:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                                timeout=datetime.timedelta(seconds=120), device_id=device)
        group = ParallelGroup(rank, tp, dist.group.WORLD)
    args = ServerArgs(model_path=folder, load_format="dummy", dtype="bfloat16", device="cuda",
                      max_total_tokens=max(ns.batch) * (ns.input_len + ns.steps + ns.profile_steps + 23) + 64, context_length=4096,
                      cuda_graph_max_bs=max(max(ns.batch), 8), max_running_requests=max(max(ns.batch), 8),
                      attention_backend=ns.attention_backend, disable_custom_all_reduce=variant == "nccl")
    # The runner gives its groups the symmetric-memory all-reduce itself (serving's default); nccl opts out.
    runner = ModelRunner(args, folder, ParallelContext.tensor_parallel(group), device)
    name = f"tp{tp}" if tp == 1 else f"tp{tp}_{variant}"
    res: dict[str, Any] = {}
    for bs in ns.batch:
        r = time_decode(runner, bs, ns, trace=rank == 0 and ns.profile_steps > 0)
        if tp > 1:
            r |= time_allreduce(runner.ctx.mlp, bs, runner.model_config.hidden_size, device)
            r["symm_mem_all_reduce"] = runner.ctx.mlp.fast is not None
        res[f"{name}_bs{bs}"] = r
    if rank == 0:
        out.put(res)
    if tp > 1:
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < max(ns.tp_sizes):
        print(f"needs {max(ns.tp_sizes)} CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-tp-step-") as tmp:
        folder = str(make_model_folder(ns.model_config, Path(tmp) / "model"))
        runs = [(tp, v) for tp in ns.tp_sizes for v in (ns.variants if tp > 1 else ["-"])]
        for i, (tp, variant) in enumerate(runs):
            q = ctx.Queue()
            port = 29500 + (os.getpid() + i) % 1000
            procs = [ctx.Process(target=rank_main, args=(r, tp, variant, port, folder, ns, q)) for r in range(tp)]
            for p in procs:
                p.start()
            results |= q.get(timeout=600)
            for p in procs:
                p.join(timeout=60)
    for bs in ns.batch:
        base = results.get(f"tp1_bs{bs}")
        for v in ns.variants:
            top = results.get(f"tp{max(ns.tp_sizes)}_{v}_bs{bs}")
            if base and top:
                results[f"summary_{v}_bs{bs}"] = {"step_ratio": top["step_ms"] / base["step_ms"],
                                                  "device_ratio": top["device_ms"] / base["device_ms"]}
    rows = [(f"{k} {m}", v) for k, r in results.items() for m, v in r.items()]
    print_table("TP decode step without Ray (rank 0)", rows)
    print(f"wrote {write_result(ns.out, 'tp_step', results, vars(ns), argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
