"""The card's shape against the in-process Engine, on a 2-GPU machine, 8B-shaped dummy model (bf16).

Runs, one after the other on the same GPUs, with default flags:
  inproc    the in-process Engine (TP=1, no Ray): the baseline
  ray_tp1   one TP rank on Ray (the SchedulerActor holds the GPU)
  ray_tp2   two TP ranks on Ray (rank 1 follows over the StepChannel: the shm ring, the default on one
            node; symmetric-memory all-reduce in graphs); ray_tp2_gloo the same over the gloo channel
and reports for each the decode step time at each --batch size (streamed token timestamps: the median
over requests of the gap between consecutive tokens, first token excluded), the Ray overhead
(ray_tp1 - inproc), the TP=2 / in-process TP=1 ratios, how many greedy tokens agree with inproc, and —
for inproc and ray_tp1 — offline throughput on --num-prompts prompts of --tput-input-len/--tput-output-len
with the device idle fraction (1 - summed batch device time / wall time). For TP=2 each timed burst
also gets the follower's step trace (`step_trace_bs{N}`: runtime/cluster/step_trace.py says what each
number means: channel latency, follower decode/launch, its lag behind rank 0, rank 0's host time and
wait, each rank's device idle before a step), and each rank's CPU share while the replica idles.

    python benchmarks/bench_tp.py --out benchmarks/results/tp_ray_2gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from common import make_model_folder, print_table, write_result  # noqa: E402

from runtime.config import ServerArgs  # noqa: E402
from runtime.messages import GenerateRequest  # noqa: E402
from runtime.sampling.params import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke run of this script's paths (e.g. --model-config Tiny-Llama-smoke)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--num-prompts", type=int, default=500, help="throughput run; 0 skips it")
    p.add_argument("--tput-input-len", type=int, default=462)
    p.add_argument("--tput-output-len", type=int, default=256)
    p.add_argument("--max-total-tokens", type=int, default=None, help="default: what memory allows")
    p.add_argument("--step-channels", nargs="+", default=["shm", "gloo"], choices=["shm", "gloo"],
                   help="one ray_tp2 run per StepChannel kind")
    p.add_argument("--idle-s", type=float, default=3.0, help="how long each rank's idle CPU is sampled")
    p.add_argument("--out", default="benchmarks/results/tp_ray_2gpu.json")
    return p.parse_args(argv)


async def timed_stream(client: Any, req: GenerateRequest) -> tuple[list[int], list[float]]:
    ids, stamps = [], []
    async for out in client.stream(client.validate(req)):
        now = time.perf_counter()
        for t in out.new_token_ids:
            ids.append(t)
            stamps.append(now)
    return ids, stamps


def idle_cpu_share(pids: list[int], seconds: float) -> list[float]:
    """Each process's CPU time over `seconds` of wall time (1.0 = one busy core), from /proc."""
    def ticks(pid: int) -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    before = [ticks(p) for p in pids]
    time.sleep(seconds)
    hz = os.sysconf("SC_CLK_TCK")
    return [(ticks(p) - b) / hz / seconds for p, b in zip(pids, before)]


def measure(client: Any, ns: argparse.Namespace, prompt: list[int], followers: list[Any] = ()) -> dict[str, Any]:
    import ray

    params = SamplingParams(max_new_tokens=ns.output_len, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}

    async def burst(tag: str, bs: int) -> list[tuple[list[int], list[float]]]:
        return await asyncio.gather(*(timed_stream(client, GenerateRequest(
            rid=f"{tag}-{j}-{time.time_ns()}", input_ids=prompt, sampling_params=params)) for j in range(bs)))

    for bs in ns.batch:
        steps, idle, engine_steps = [], [], []
        for i in range(ns.repeats + 1):  # the first run warms up (and captures graphs of this size)
            stats0 = asyncio.run(client.stats())
            before = stats0.device_busy_s
            if followers and i > 0:
                ray.get([f.trace_steps.remote(True) for f in followers])
            t0 = time.perf_counter()
            runs = asyncio.run(burst(f"b{bs}-{i}", bs))
            wall = time.perf_counter() - t0
            stats1 = asyncio.run(client.stats())
            busy = stats1.device_busy_s - before
            d0, d1 = stats0.forward_modes.get("DECODE"), stats1.forward_modes.get("DECODE")
            if i > 0 and d0 is not None and d1 is not None and d1.batches > d0.batches:
                engine_steps.append((d1.time_s - d0.time_s) / (d1.batches - d0.batches))
            if followers and i > 0:
                out.setdefault(f"step_trace_bs{bs}", []).append(ray.get(followers[0].trace_steps.remote(False)))
                ray.get([f.trace_steps.remote(False) for f in followers[1:]])
            if i == 0:
                out.setdefault("tokens", runs[0][0])
                continue
            gaps = sorted((st[-1] - st[1]) / (len(st) - 2) for _ids, st in runs)
            steps.append(gaps[len(gaps) // 2])
            idle.append(max(0.0, 1.0 - busy / wall) if busy > 0 else None)
        step = sorted(steps)[len(steps) // 2]
        out[f"decode_step_ms_bs{bs}"] = 1000 * step
        out[f"decode_step_ms_bs{bs}_each"] = [1000 * s for s in steps]
        # The scheduler's own mean decode step (time between consecutive results), free of the client's
        # stream delivery: far below decode_step_ms, the client, not the engine, set the pace.
        out[f"engine_decode_step_ms_bs{bs}"] = [1000 * s for s in engine_steps]
        # Rank 0's device idle share over the burst (prefill included): a follower that lags shows here
        # as rank 0's all-reduces waiting, i.e. as busy time, not idle; host-side gaps show as idle.
        out[f"device_idle_fraction_bs{bs}"] = idle
    return out


def throughput(client: Any, ns: argparse.Namespace) -> dict[str, Any]:
    """Offline request throughput with every prompt submitted at once (distinct prompts: no cache hits)."""
    params = SamplingParams(max_new_tokens=ns.tput_output_len, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(rid=f"t{i}-{time.time_ns()}", sampling_params=params,
                            input_ids=[1000 + (i * 7919 + j * 37) % 30000 for j in range(ns.tput_input_len)])
            for i in range(ns.num_prompts)]

    async def run() -> tuple[float, float]:
        before = await client.stats()
        t0 = time.perf_counter()
        await asyncio.gather(*(timed_stream(client, r) for r in reqs))
        wall = time.perf_counter() - t0
        return wall, (await client.stats()).device_busy_s - before.device_busy_s

    wall, busy = asyncio.run(run())
    return {"requests_per_s": ns.num_prompts / wall, "output_tokens_per_s": ns.num_prompts * ns.tput_output_len / wall,
            "wall_s": wall, "device_idle_fraction": max(0.0, 1.0 - busy / wall) if busy > 0 else None}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    import torch

    if ns.device == "cuda" and torch.cuda.device_count() < 2:
        print(f"bench_tp needs 2 CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from tiny_models import make_tokenizer

    from runtime import Engine
    from runtime.cluster.launch import create_ray_engine_client

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-tp-") as tmp:
        folder = make_model_folder(ns.model_config, Path(tmp) / "model")
        make_tokenizer(folder)  # ids come from the prompt below; the scheduler only needs EOS and decode
        base = dict(model_path=str(folder), load_format="dummy", dtype="bfloat16" if ns.device == "cuda" else "float32",
                    device=ns.device,
                    max_total_tokens=ns.max_total_tokens, context_length=4096)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        prompt = [(1000 + (i * 37) % 20000) % vocab for i in range(ns.input_len)]

        engine = Engine(server_args=ServerArgs(**base))
        try:
            results["inproc"] = measure(engine, ns, prompt)
            if ns.num_prompts:
                results["inproc"]["throughput"] = throughput(engine, ns)
        finally:
            engine.shutdown()
        del engine
        if ns.device == "cuda":
            torch.cuda.empty_cache()
        runs = [("ray_tp1", 1, "auto")] + [("ray_tp2" if k == "shm" else f"ray_tp2_{k}", 2, k)
                                          for k in ns.step_channels]
        for name, tp, channel in runs:
            t0 = time.perf_counter()
            try:
                client = create_ray_engine_client(ServerArgs(**base, tp_size=tp, use_ray=True, step_channel=channel))
            except Exception as e:  # one broken variant must not cost the others' numbers
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{name} failed to start: {e}", file=sys.stderr)
                ray.shutdown()
                continue
            startup = time.perf_counter() - t0
            try:
                workers = client.groups[0].workers
                followers = workers[1:]
                r = results[name] = {"startup_s": startup, "all_reduce": client.groups[0].info.all_reduce}
                if followers:
                    r["step_channel"] = ray.get(followers[0].step_channel.remote())
                r |= measure(client, ns, prompt, followers)
                if tp == 1 and ns.num_prompts:
                    r["throughput"] = throughput(client, ns)
                time.sleep(0.5)  # the last step's spin ends; then every rank should sleep
                r["idle_cpu_share_per_rank"] = idle_cpu_share(ray.get([w.pid.remote() for w in workers]), ns.idle_s)
            except Exception as e:
                results[name]["error"] = f"{type(e).__name__}: {e}"
                print(f"{name} failed: {e}", file=sys.stderr)
            finally:
                client.shutdown()
                ray.shutdown()

    ref = results["inproc"]["tokens"]
    for r in results.values():
        if "tokens" not in r:
            continue
        toks = r.pop("tokens")
        r["tokens_equal_inproc"] = toks == ref
        r["tokens_agreeing_prefix"] = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), len(ref))
    inproc, tp1 = results["inproc"], results.get("ray_tp1")
    summary: dict[str, Any] = {}
    for bs in ns.batch:
        key = f"decode_step_ms_bs{bs}"
        if tp1 and key in tp1:
            summary[f"ray_tp1_overhead_ms_bs{bs}"] = tp1[key] - inproc[key]
        for name, r in results.items():
            if name.startswith("ray_tp2") and key in r:
                summary[f"{name}_over_inproc_tp1_bs{bs}"] = r[key] / inproc[key]
                engine, base_engine = r.get(f"engine_{key}"), inproc.get(f"engine_{key}")
                if engine and base_engine:  # the same ratio from the schedulers' own step times
                    summary[f"{name}_over_inproc_tp1_engine_bs{bs}"] = (sorted(engine)[len(engine) // 2]
                                                                        / sorted(base_engine)[len(base_engine) // 2])
    if tp1 and "throughput" in tp1 and "throughput" in inproc:
        summary["ray_tp1_over_inproc_throughput"] = (tp1["throughput"]["requests_per_s"]
                                                     / inproc["throughput"]["requests_per_s"])
        summary["ray_tp1_device_idle_fraction"] = tp1["throughput"]["device_idle_fraction"]
        summary["inproc_device_idle_fraction"] = inproc["throughput"]["device_idle_fraction"]
    results["summary"] = summary
    rows = [(f"{k} {m}", v[m]) for k, v in results.items() for m in v
            if m.startswith("decode_step_ms_bs") and not m.endswith("each")]
    rows += [(f"{k} {m}", str([round(x, 2) for x in v[m]])) for k, v in results.items() for m in v
             if m.startswith("engine_decode_step_ms_bs")]
    rows += [(f"summary {m}", v) for m, v in summary.items() if v is not None]
    print_table("decode step (ms), throughput, and the Ray path against in-process", rows)
    trace_rows = [(f"{name} bs{bs} {k}", v["median"]) for name, r in results.items()
                  for bs in ns.batch for t in r.get(f"step_trace_bs{bs}", [])[-1:]
                  for k, v in t.items() if isinstance(v, dict)]
    trace_rows += [(f"{name} idle CPU share per rank", str([round(x, 3) for x in r["idle_cpu_share_per_rank"]]))
                   for name, r in results.items() if "idle_cpu_share_per_rank" in r]
    if trace_rows:
        print_table("TP follower step trace (median, us) and idle CPU", trace_rows)
    out = write_result(ns.out, "tp_ray", results, vars(ns), argv)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
