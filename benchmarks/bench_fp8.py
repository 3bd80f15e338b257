"""FP8 side by side on one GPU (8B-shaped dummy weights): batch-1 decode step bf16 vs FP8 weights, KV
pool token capacity bf16 vs FP8 KV, and 1000/1000 x 1000 offline output tok/s bf16 vs FP8 KV. Each
configuration runs in its own subprocess (a fresh engine and a clean device), all in one JSON.

    python -m benchmarks.bench_fp8 --part decode --output-file benchmarks/results/fp8_decode_h100.json
    python -m benchmarks.bench_fp8 --part throughput --output-file benchmarks/results/fp8_throughput_h100.json

Targets (issue 16): decode step <= 3.4 ms with FP8 weights on H100; >= 8.5k output tok/s bf16 and
>= 11k with FP8 KV at 1000/1000 x 1000; the FP8 KV pool holds ~2x the tokens. A tiny smoke form runs
on CPU: --model-config <small config> --num-prompts 4 --input-len 16 --output-len 8."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import print_table, write_result

MODES = {
    "bf16": {},
    "fp8_weights": {"quantization": "fp8"},  # the LM head in FP8 where the GEMV serves it (the default)
    "fp8_weights_16bit_head": {"quantization": "fp8", "disable_fp8_lm_head": True},  # --disable-fp8-lm-head
    "fp8_weights_lm_head": {"quantization": "fp8", "fp8_lm_head": True},  # --fp8-lm-head: every call
    "fp8_kv": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8_weights_kv": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
    # FP8 KV without its default rotation (--kv-cache-rotation, runtime/mem_cache/kv_rotation.py): its cost
    "fp8_kv_rotation_none": {"kv_cache_dtype": "fp8_e4m3", "kv_cache_rotation": "none"},
    "fp8_weights_kv_rotation_none": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3", "kv_cache_rotation": "none"},
}
PARTS = {"decode": ("batch1", ["bf16", "fp8_weights", "fp8_weights_kv"]),
         "throughput": ("throughput", ["bf16", "fp8_kv"])}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=sorted(PARTS), required=True)
    p.add_argument("--modes", default=None, help="comma-separated subset of " + ", ".join(MODES))
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=None, help="default 1000 (128 for decode)")
    p.add_argument("--output-len", type=int, default=None, help="default 1000 (512 for decode)")
    p.add_argument("--max-running-requests", type=int, default=1024)
    p.add_argument("--cuda-graph-max-bs", type=int, default=256)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def _offline_argv(args: argparse.Namespace, kind: str, mode: str, out: Path) -> list[str]:
    argv = [sys.executable, "-m", "benchmarks.bench_offline", "--model-config", args.model_config,
            "--output-file", str(out)]
    if kind == "batch1":
        argv += ["--batch1-decode", "--input-len", str(args.input_len or 128),
                 "--output-len", str(args.output_len or 512)]
    else:
        argv += ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len or 1000),
                 "--output-len", str(args.output_len or 1000), "--max-running-requests",
                 str(args.max_running_requests), "--cuda-graph-max-bs", str(args.cuda_graph_max_bs)]
    for k, v in MODES[mode].items():
        argv += ["--" + k.replace("_", "-")] + ([] if v is True else [str(v)])  # a switch takes no value
    if args.attention_backend != "auto":
        argv += ["--attention-backend", args.attention_backend]
    return argv


def run_mode(args: argparse.Namespace, kind: str, mode: str, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{mode}.json"
    argv = _offline_argv(args, kind, mode, out)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
    log = proc.stdout + proc.stderr
    capacity = [line for line in log.splitlines() if "max_total_tokens" in line or "KV pool" in line]
    if proc.returncode != 0 or not out.is_file():
        return {"error": f"exit {proc.returncode}", "log_tail": log[-3000:]}
    res = json.loads(out.read_text())["results"]
    res["wall_s"] = time.perf_counter() - t0
    res["kv_pool_log"] = capacity[-2:]
    if res.get("failed_requests"):
        res["log_tail"] = log[-3000:]
    return res


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    kind, modes = PARTS[args.part]
    if args.modes:
        modes = args.modes.split(",")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-fp8-") as tmp:
        for mode in modes:
            results[mode] = run_mode(args, kind, mode, Path(tmp))
            print(mode, {k: v for k, v in results[mode].items() if isinstance(v, (int, float))}, flush=True)
            if "error" in results[mode]:
                print(results[mode]["log_tail"], flush=True)
    summary = _summary(kind, results)
    print_table(f"FP8 {args.part}", list(summary.items()))
    if args.output_file:
        write_result(args.output_file, f"fp8_{args.part}", results | {"summary": summary}, vars(args),
                     argv=sys.argv if argv is None else ["bench_fp8.py", *argv])
    return results


def _summary(kind: str, results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, r in results.items():
        if "error" in r:
            out[f"{mode}_error"] = r["error"]
        elif kind == "batch1":
            out[f"{mode}_decode_step_ms"] = r["decode_step_ms"]
        else:
            out[f"{mode}_output_tok_s"] = r["output_throughput"]
            if r.get("max_total_tokens"):
                out[f"{mode}_kv_pool_tokens"] = r["max_total_tokens"]
    if out.get("bf16_kv_pool_tokens") and out.get("fp8_kv_kv_pool_tokens"):
        out["kv_capacity_ratio"] = out["fp8_kv_kv_pool_tokens"] / out["bf16_kv_pool_tokens"]
    return out


if __name__ == "__main__":
    main()
