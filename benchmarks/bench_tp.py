"""The card's shape against the in-process Engine, on a 2-GPU machine, 8B-shaped dummy model (bf16).

Runs (--paths), one after the other on the same GPUs, with default flags:
  inproc        the in-process Engine (TP=1, no Ray): the baseline
  ray_tp1       one TP rank on Ray (the SchedulerActor holds the GPU; requests and outputs over its link)
  ray_tp1_poll  the same over Ray actor calls and output long-polls (--disable-request-link)
  ray_tp2       two TP ranks on Ray (rank 1 follows over the StepChannel: the shm ring on one node)
  ray_tp2_gloo  the same over the gloo StepChannel
and reports for each the decode step time at each --batch size (streamed token timestamps: the median
over requests of the gap between consecutive tokens, first token excluded), the rank-0 device idle share
per burst, the first token's hops per burst (median ms: see bench_ttft_paths.py), the Ray overhead
(ray_tp1 - inproc), the TP=2 / in-process TP=1 ratios, how many greedy tokens agree with inproc, and —
for the TP=1 paths — offline throughput on --num-prompts prompts of --tput-input-len/--tput-output-len
with the device idle fraction (1 - summed batch device time / wall time). Around the Ray runs, TpProbe
(tp_probe.py) adds the scheduler's own decode step (engine_decode_step_ms_bs{N}), the TP follower's step
trace per timed burst (step_trace_bs{N}) and each rank's idle CPU share.

    python benchmarks/bench_tp.py --out benchmarks/results/tp_ray_2gpu.json                  # 2 GPUs
    python benchmarks/bench_tp.py --paths inproc ray_tp1 ray_tp1_poll --out tp_ray_1gpu.json  # 1 GPU
    python benchmarks/bench_tp.py --simulated-device --paths inproc ray_tp1 ray_tp1_poll      # CPU, no GPU
    python benchmarks/bench_tp.py --device cpu --model-config Tiny-Llama-smoke --num-prompts 0  # CPU smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_ttft_paths import hops, start_simulated_ray  # noqa: E402
from common import make_model_folder, print_table, write_result  # noqa: E402
from tp_probe import TpProbe, engine_decode_step_s, probe_rows, tp2_summary  # noqa: E402

from runtime.config import ServerArgs  # noqa: E402
from runtime.messages import GenerateRequest  # noqa: E402
from runtime.sampling.params import SamplingParams  # noqa: E402

PATH_ARGS: dict[str, dict[str, Any]] = {
    "inproc": {}, "ray_tp1": {"use_ray": True}, "ray_tp1_poll": {"use_ray": True, "disable_request_link": True},
    "ray_tp2": {"use_ray": True, "tp_size": 2}, "ray_tp2_gloo": {"use_ray": True, "tp_size": 2, "step_channel": "gloo"}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--num-prompts", type=int, default=500, help="throughput run; 0 skips it")
    p.add_argument("--tput-input-len", type=int, default=462)
    p.add_argument("--tput-output-len", type=int, default=256)
    p.add_argument("--max-total-tokens", type=int, default=None, help="default: what memory allows")
    p.add_argument("--paths", nargs="+", default=["inproc", "ray_tp1", "ray_tp2", "ray_tp2_gloo"],
                   choices=sorted(PATH_ARGS))
    p.add_argument("--simulated-device", action="store_true",
                   help="no model: benchmarks/simulated_device.py stands in for the GPU (host-side costs only)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke run of this script (e.g. --model-config Tiny-Llama-smoke)")
    p.add_argument("--idle-s", type=float, default=3.0, help="how long each Ray rank's idle CPU is sampled")
    p.add_argument("--out", default="benchmarks/results/tp_ray_2gpu.json")
    return p.parse_args(argv)


async def timed_stream(client: Any, req: GenerateRequest) -> tuple[list[int], list[float], dict[str, float]]:
    ids, stamps, first = [], [], {}
    req = msgspec.structs.replace(req, arrival_time=time.monotonic())
    async for out in client.stream(client.validate(req)):
        now = time.perf_counter()
        if not first and out.new_token_ids:
            first = hops(req.arrival_time, now, out)
        for t in out.new_token_ids:
            ids.append(t)
            stamps.append(now)
    return ids, stamps, first


def median_hops(runs: list[tuple[list[int], list[float], dict[str, float]]]) -> dict[str, float]:
    keys = set.intersection(*(set(r[2]) for r in runs)) if runs else set()
    return {k: round(statistics.median(r[2][k] for r in runs), 3) for k in sorted(keys)}


def measure(client: Any, ns: argparse.Namespace, prompt: list[int], probe: TpProbe | None = None) -> dict[str, Any]:
    params = SamplingParams(max_new_tokens=ns.output_len, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}

    async def burst(tag: str, bs: int) -> list[tuple[list[int], list[float], dict[str, float]]]:
        return await asyncio.gather(*(timed_stream(client, GenerateRequest(
            rid=f"{tag}-{j}-{time.time_ns()}", input_ids=prompt, sampling_params=params)) for j in range(bs)))

    for bs in ns.batch:
        steps, idle, first_hops, engine_steps = [], [], [], []
        for i in range(ns.repeats + 1):  # the first run warms up (and captures graphs of this size)
            stats0 = asyncio.run(client.stats())
            if probe and i:
                probe.start_burst()
            t0 = time.perf_counter()
            runs = asyncio.run(burst(f"b{bs}-{i}", bs))
            wall = time.perf_counter() - t0
            stats1 = asyncio.run(client.stats())
            busy = stats1.device_busy_s - stats0.device_busy_s
            if probe and i and (trace := probe.end_burst()) is not None:
                out.setdefault(f"step_trace_bs{bs}", []).append(trace)
            if i and (engine_step := engine_decode_step_s(stats0, stats1)) is not None:
                engine_steps.append(engine_step)
            if i == 0:
                out.setdefault("tokens", runs[0][0])
                continue
            gaps = sorted((st[-1] - st[1]) / (len(st) - 2) for _ids, st, _h in runs)
            first_hops.append(median_hops(runs))
            steps.append(gaps[len(gaps) // 2])
            idle.append(max(0.0, 1.0 - busy / wall) if busy > 0 else None)
        step = sorted(steps)[len(steps) // 2]
        out[f"decode_step_ms_bs{bs}"] = 1000 * step
        out[f"decode_step_ms_bs{bs}_each"] = [1000 * s for s in steps]
        out[f"engine_decode_step_ms_bs{bs}"] = [1000 * s for s in engine_steps]  # far below: the client set the pace
        # Rank 0's device idle share over the burst (prefill included): a follower that lags shows here
        # as rank 0's all-reduces waiting, i.e. as busy time, not idle; host-side gaps show as idle.
        out[f"device_idle_fraction_bs{bs}"] = idle
        out[f"first_token_hops_ms_bs{bs}"] = first_hops
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

    gpus = max(PATH_ARGS[p].get("tp_size", 1) for p in ns.paths)
    if ns.device == "cuda" and not ns.simulated_device and torch.cuda.device_count() < gpus:
        print(f"bench_tp --paths {' '.join(ns.paths)} needs {gpus} CUDA GPUs, found {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    if ns.simulated_device and gpus > 1:
        print("--simulated-device runs TP=1 paths only", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from tiny_models import make_tokenizer

    from runtime import Engine
    from runtime.cluster.launch import create_ray_engine_client

    device, dtype = ns.device, "bfloat16" if ns.device == "cuda" else "float32"
    if ns.simulated_device:
        import simulated_device

        simulated_device.install()
        device, dtype = "cpu", "float32"
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-tp-") as tmp:
        folder = make_model_folder(ns.model_config, Path(tmp) / "model")
        make_tokenizer(folder)  # ids come from the prompt below; the scheduler only needs EOS and decode
        base = dict(model_path=str(folder), load_format="dummy", device=device, dtype=dtype,
                    max_total_tokens=ns.max_total_tokens, context_length=4096)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        prompt = [(1000 + (i * 37) % 20000) % vocab for i in range(ns.input_len)]
        for path in ns.paths:
            args = ServerArgs(**base, **PATH_ARGS[path])
            t0 = time.perf_counter()
            try:  # one broken path must not cost the others' numbers
                if args.use_ray and ns.simulated_device:
                    start_simulated_ray()
                client = create_ray_engine_client(args) if args.use_ray else Engine(server_args=args)
            except Exception as e:
                results[path] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{path} failed to start: {e}", file=sys.stderr)
                continue
            r = results[path] = {"startup_s": time.perf_counter() - t0}
            try:
                probe = TpProbe(client) if args.use_ray else None
                if probe:
                    r |= probe.info() | {"all_reduce": client.groups[0].info.all_reduce}
                r |= measure(client, ns, prompt, probe)
                if args.tp_size == 1 and ns.num_prompts:
                    r["throughput"] = throughput(client, ns)
                if probe:
                    r["idle_cpu_share_per_rank"] = probe.idle_cpu_share(ns.idle_s)
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {e}"
                print(f"{path} failed: {e}", file=sys.stderr)
            finally:
                client.shutdown()
                if args.use_ray:
                    import ray

                    ray.shutdown()
            del client
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    ref = results.get("inproc", {}).get("tokens")
    for r in results.values():
        toks = r.pop("tokens", None)
        if ref is None or toks is None:
            continue
        r["tokens_equal_inproc"] = toks == ref
        r["tokens_agreeing_prefix"] = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), len(ref))
    inproc = results.get("inproc", {})
    summary: dict[str, Any] = {}
    for bs in ns.batch if inproc else []:
        key = f"decode_step_ms_bs{bs}"
        for name in ("ray_tp1", "ray_tp1_poll"):
            if key in results.get(name, {}) and key in inproc:
                summary[f"{name}_overhead_ms_bs{bs}"] = results[name][key] - inproc[key]
    summary |= tp2_summary(results, ns.batch)
    for name in ("ray_tp1", "ray_tp1_poll"):
        if "throughput" in inproc and "throughput" in results.get(name, {}):
            summary[f"{name}_over_inproc_throughput"] = (results[name]["throughput"]["requests_per_s"]
                                                         / inproc["throughput"]["requests_per_s"])
            summary[f"{name}_device_idle_fraction"] = results[name]["throughput"]["device_idle_fraction"]
    if "throughput" in inproc:
        summary["inproc_device_idle_fraction"] = inproc["throughput"]["device_idle_fraction"]
    results["summary"] = summary
    rows = [(f"{k} {m}", v[m]) for k, v in results.items() for m in v
            if m.startswith("decode_step_ms_bs") and not m.endswith("each")]
    rows += [(f"summary {m}", v) for m, v in summary.items() if v is not None]
    print_table("decode step (ms), throughput, and the Ray path against in-process", rows)
    print_table("scheduler-timed steps (ms), TP follower step traces, idle CPU", probe_rows(results, ns.batch))
    out = write_result(ns.out, "tp_ray", results, vars(ns), argv)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
