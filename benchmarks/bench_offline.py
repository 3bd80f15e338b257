"""Offline throughput through the in-process Engine (no HTTP): random token-id prompts, ignore EOS, all
requests submitted at once. Or, with --batch1-decode, the mean decode step time at batch 1.

    python -m benchmarks.bench_offline --model-config Llama-3.1-8B-Instruct --num-prompts 1000 \
        --input-len 1024 --output-len 1024 --range-ratio 0.5
    python -m benchmarks.bench_offline --model-config Llama-3.1-8B-Instruct --batch1-decode
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import (
    load_model_config,
    make_model_folder,
    print_table,
    random_token_ids,
    sample_lengths,
    special_token_ids,
    write_result,
)
from benchmarks.device_memory import device_memory
from benchmarks.system_sampler import SystemSampler, visible_gpu_index
from benchmarks.triton_compiles import TritonCompiles
from runtime.config import ServerArgs

# Set explicitly by this script (or resolved from --model-config), so not passed through as extras.
_OWN_FIELDS = ("model_path", "dtype", "load_format")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default=None,
                   help="name in benchmarks/configs/ or a config.json path; implies --load-format dummy")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=None, help="default 1024 (128 with --batch1-decode)")
    p.add_argument("--output-len", type=int, default=None, help="default 1024 (512 with --batch1-decode)")
    p.add_argument("--range-ratio", type=float, default=1.0, help="lengths uniform in [ratio * len, len]")
    p.add_argument("--warmup", type=int, default=4, help="warmup prompts run before timing")
    p.add_argument("--seed", type=int, default=1, help="workload seed")
    p.add_argument("--batch1-decode", action="store_true",
                   help="measure the mean decode step at batch 1")
    p.add_argument("--batch1-repeats", type=int, default=3)
    p.add_argument("--output-file", default=None)
    engine = p.add_argument_group("engine (passed to Engine(...) when they differ from ServerArgs' defaults)")
    ServerArgs.add_cli_args(engine)
    p.set_defaults(dtype="bfloat16", load_format=None)
    args = p.parse_args(argv)
    if args.input_len is None:
        args.input_len = 128 if args.batch1_decode else 1024
    if args.output_len is None:
        args.output_len = 512 if args.batch1_decode else 1024
    if (args.model_config is None) == (args.model_path is None):
        p.error("give exactly one of --model-config and --model-path")
    if args.load_format is None:
        args.load_format = "dummy" if args.model_config else "auto"
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--num-prompts, --input-len and --output-len must be >= 1")
    return args


def engine_extras(args: argparse.Namespace) -> dict[str, Any]:
    """ServerArgs flags given on the command line (those differing from the defaults)."""
    out = {}
    for f in dataclasses.fields(ServerArgs):
        if f.name in _OWN_FIELDS:
            continue
        if getattr(args, f.name) != f.default:
            out[f.name] = getattr(args, f.name)
    return out


def build_workload(args: argparse.Namespace, config: dict[str, Any], n: int | None = None,
                   seed_offset: int = 0) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Seeded random prompts and one greedy, EOS-ignoring sampling dict per prompt."""
    n = args.num_prompts if n is None else n
    rng = random.Random(args.seed + seed_offset)
    in_lens = sample_lengths(rng, n, args.input_len, args.range_ratio)
    out_lens = sample_lengths(rng, n, args.output_len, args.range_ratio)
    prompts = random_token_ids(rng, in_lens, int(config["vocab_size"]), special_token_ids(config))
    params = [{"max_new_tokens": o, "temperature": 0.0, "ignore_eos": True} for o in out_lens]
    return prompts, params


def stats_snapshot(engine: Any) -> dict[str, dict[str, float]]:
    """{mode: {batches, tokens, time_s}} from engine.get_stats() (plus "retractions" and "gc_pauses"), or {}
    if the engine keeps none. time_s: the scheduler's forward time of that mode, so a run says where its
    time went."""
    try:
        stats = engine.get_stats()
        modes = stats.forward_modes
    except AttributeError:
        return {}
    out = {str(getattr(k, "name", k)): {"batches": int(v.batches), "tokens": int(v.tokens),
                                        "time_s": round(float(getattr(v, "time_s", 0.0)), 3)} for k, v in modes.items()}
    out["retractions"] = {"batches": int(getattr(stats, "retractions", 0)), "tokens": 0, "time_s": 0.0}
    # The scheduler process's garbage collections (runtime/gc_guard.py): the slow ones and all their time.
    out["gc_pauses"] = {"batches": int(getattr(stats, "gc_slow_pauses", 0)), "tokens": 0,
                        "time_s": round(float(getattr(stats, "gc_pause_s", 0.0)), 3)}
    return out


def stats_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    zero = {"batches": 0, "tokens": 0, "time_s": 0.0}
    return {m: {k: round(after[m][k] - before.get(m, zero)[k], 3) for k in zero} for m in after
            if after[m] != before.get(m, zero)}


def run_throughput(engine: Any, args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    if args.warmup > 0:
        warm_prompts, warm_params = build_workload(args, config, n=args.warmup, seed_offset=1000)
        engine.generate(input_ids=warm_prompts, sampling_params=[p | {"max_new_tokens": min(16, p["max_new_tokens"])}
                                                                  for p in warm_params])
    prompts, params = build_workload(args, config)
    # Tuples, as the HTTP gateway holds prompts: the Engine's scheduler thread shares this process, and a
    # full collection (which stops it) walks every element of every tracked list: 1M here at 1000 x 1000.
    prompts = [tuple(p) for p in prompts]
    before = stats_snapshot(engine)
    busy0 = getattr(engine.get_stats(), "device_busy_s", 0.0)
    with TritonCompiles() as compiles, SystemSampler(gpu_index=visible_gpu_index()) as system:
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        duration = time.perf_counter() - t0
    modes = stats_delta(before, stats_snapshot(engine))
    busy = getattr(engine.get_stats(), "device_busy_s", 0.0) - busy0
    n_in = sum(o["usage"]["prompt_tokens"] for o in outs)
    n_out = sum(o["usage"]["completion_tokens"] for o in outs)
    short = sum(1 for o, p in zip(outs, params, strict=True) if o["usage"]["completion_tokens"] != p["max_new_tokens"])
    errors = [o["error"] for o in outs if o.get("error")]
    if errors:  # a failed request is not a fast one: say so where the numbers are read
        print(f"bench_offline: {len(errors)} of {len(outs)} requests failed; first: {errors[0]}", file=sys.stderr)
    return {
        "num_prompts": len(prompts), "duration_s": duration,
        "request_throughput": len(prompts) / duration,
        "input_throughput": n_in / duration, "output_throughput": n_out / duration,
        "total_throughput": (n_in + n_out) / duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "cached_tokens": sum(o["usage"].get("cached_tokens", 0) for o in outs),
        "requests_with_wrong_output_len": short,
        "failed_requests": len(errors), "first_error": errors[0] if errors else None,
        "forward_modes": modes,
        # Share of the run the device sat idle between batches (CUDA events; None on CPU).
        "device_idle_fraction": max(0.0, 1.0 - busy / duration) if busy > 0 else None,
        "max_total_tokens": getattr(engine.get_stats(), "max_total_tokens", None),  # KV pool size in tokens
        "triton_compiles_in_run": compiles.summary(),  # JIT compiles inside the timed run (host stalls)
        "system_during_run": system.summary(),  # SM clock, throttling, power; host CPU busy / steal
        "device_memory": device_memory(engine),  # pool, weights, and the peak of everything else (GiB)
    }


def run_batch1_decode(engine: Any, args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """Decode step = (E2E - TTFT) / (out - 1), TTFT from a 1-token request on a different prompt of the
    same length (a shared prompt would hit the prefix cache and shrink the second prefill)."""
    prompts, _ = build_workload(args, config, n=2 * args.batch1_repeats + 1)
    params = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=[prompts[-1]], sampling_params=params | {"max_new_tokens": 32})  # warmup
    ttfts, e2es, steps = [], [], []
    for i in range(args.batch1_repeats):
        t0 = time.perf_counter()
        engine.generate(input_ids=[prompts[2 * i]], sampling_params=params | {"max_new_tokens": 1})
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = engine.generate(input_ids=[prompts[2 * i + 1]], sampling_params=params)[0]
        e2e = time.perf_counter() - t0
        n_out = out["usage"]["completion_tokens"]
        ttfts.append(ttft)
        e2es.append(e2e)
        steps.append((e2e - ttft) / max(1, n_out - 1))
    step = sum(steps) / len(steps)
    return {"input_len": len(prompts[0]), "output_len": args.output_len, "repeats": args.batch1_repeats,
            "ttft_ms": 1000 * sum(ttfts) / len(ttfts), "e2e_ms": 1000 * sum(e2es) / len(e2es),
            "decode_step_ms": 1000 * step, "decode_tokens_per_s": 1.0 / step, "decode_step_ms_each": [1000 * s for s in steps]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from runtime import Engine

    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        folder = make_model_folder(args.model_config, Path(tmp) / "model") if args.model_config else Path(args.model_path)
        config = load_model_config(str(folder))
        extras = engine_extras(args)
        print(f"engine: model={folder} load_format={args.load_format} dtype={args.dtype} {extras}")
        engine = Engine(model_path=str(folder), load_format=args.load_format, dtype=args.dtype, **extras)
        try:
            results = run_batch1_decode(engine, args, config) if args.batch1_decode else run_throughput(engine, args, config)
        finally:
            engine.shutdown()
    shown = [(k, v) for k, v in results.items() if isinstance(v, (int, float))]
    print_table("Offline Batch-1 Decode" if args.batch1_decode else "Offline Throughput", shown)
    if "forward_modes" in results:
        print("forward modes:", results["forward_modes"])
    if args.output_file:
        name = "offline_batch1_decode" if args.batch1_decode else "offline_throughput"
        write_result(args.output_file, name, results, vars(args) | {"engine_extras": extras},
                     argv=sys.argv if argv is None else ["bench_offline.py", *argv])
    return results


if __name__ == "__main__":
    main()
