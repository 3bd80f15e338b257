"""Where a decode step's device time goes (issue 16): the 8B shape (dummy weights, CUDA graphs) in bf16
and FP8 weights, at batch 1 and 32, each with the decode fusions on and off (SHOAL_DECODE_FUSION), one
engine per configuration in its own subprocess. Per configuration and batch size:
- the decode step without the profiler: (time of N + 1 tokens - time of 1 token) / N, as bench_offline;
- a torch.profiler (CUPTI) trace of a few dozen steps, cut into steps at the CUDA graph replays, every
  kernel classified by name (benchmarks/trace_breakdown.py): device ms and kernel count per step per
  category (gemm, attention, norm, rotary, kv_store, activation, all_reduce, sampler, embedding, copy,
  elementwise, other), the step's wall on the device timeline and its gaps (wall minus kernel time).

    python -m benchmarks.profile_decode --output-file benchmarks/results/profile_decode_h100.json
    python -m benchmarks.profile_decode --modes bf16 --batch 1 --fusion on      # one configuration
    python -m benchmarks.profile_decode --smoke                                 # CPU, tiny config

--trace-dir DIR keeps each configuration's chrome trace (open in chrome://tracing or Perfetto)."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import load_model_config, make_model_folder, write_result  # noqa: E402
from benchmarks.trace_breakdown import StepBreakdown, breakdown, format_table  # noqa: E402
from kernels.decode_fusion import ENV_VAR as FUSION_ENV  # noqa: E402

MODES = {"bf16": {}, "fp8_weights": {"quantization": "fp8"},
         "fp8_weights_act2": {"quantization": "fp8", "fp8_act_terms": 2},
         "fp8_weights_lm_head": {"quantization": "fp8", "fp8_lm_head": True},
         "fp8_weights_16bit_head": {"quantization": "fp8", "disable_fp8_lm_head": True},
         "fp8_weights_kv": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
         "fp8_kv": {"kv_cache_dtype": "fp8_e4m3"}}
FUSION = {"on": ["1"], "off": ["0"], "both": ["0", "1"]}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--modes", default="bf16,fp8_weights", help="comma-separated subset of " + ", ".join(MODES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--fusion", choices=sorted(FUSION), default="both")
    p.add_argument("--attention-backend", default="auto",
                   help="comma-separated: each backend is its own set of configurations (e.g. auto,triton)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--timed-steps", type=int, default=64, help="decode steps timed without the profiler")
    p.add_argument("--profiled-steps", type=int, default=20, help="decode steps attributed from the trace")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--output-file", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU: Tiny-Llama-smoke, bf16, batch 1 and 2, 3 steps")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one configuration
    ns = p.parse_args(argv)
    if ns.smoke:
        ns.model_config, ns.modes, ns.batch = "Tiny-Llama-smoke", "bf16", [1, 2]
        ns.input_len, ns.timed_steps, ns.profiled_steps = 8, 3, 3
    for m in ns.modes.split(","):
        if m not in MODES:
            p.error(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    return ns


# ---- one configuration (child process) -------------------------------------------------------------
def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run_child(ns: argparse.Namespace, mode: str, out: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from runtime import Engine

    cfg = load_model_config(ns.model_config)
    vocab, rng = int(cfg["vocab_size"]), random.Random(0)
    cuda = torch.cuda.is_available()
    res: dict[str, Any] = {"mode": mode, "fusion": os.environ.get(FUSION_ENV, "1"), "batches": {}}
    with tempfile.TemporaryDirectory(prefix="shoal-prof-") as tmp:
        folder = make_model_folder(ns.model_config, Path(tmp) / "m")
        max_bs = max(ns.batch)
        engine = Engine(str(folder), load_format="dummy", dtype="bfloat16", cuda_graph_max_bs=max_bs,
                        max_running_requests=max(max_bs, 8), attention_backend=ns.attention_backend,
                        log_interval_s=1e9, **MODES[mode])
        res["attention_backend"] = engine.worker.runner.attn_backend_name
        try:
            for bs in ns.batch:
                res["batches"][str(bs)] = _profile_batch(engine, ns, bs, rng, vocab, cuda, mode, profile,
                                                         [ProfilerActivity.CPU]
                                                         + ([ProfilerActivity.CUDA] if cuda else []))
        finally:
            engine.shutdown()
    out.write_text(json.dumps(res))


def _profile_batch(engine: Any, ns: argparse.Namespace, bs: int, rng: random.Random, vocab: int, cuda: bool,
                   mode: str, profile: Any, activities: list[Any]) -> dict[str, Any]:
    greedy = {"temperature": 0.0, "ignore_eos": True}

    def gen(n_tokens: int) -> float:
        prompts = _prompts(rng, bs, ns.input_len, vocab)  # fresh prompts: no prefix-cache hits
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=greedy | {"max_new_tokens": n_tokens})
        return time.perf_counter() - t0

    gen(8)  # warm-up: every kernel compiled, graphs replayed once
    one, many = gen(1), gen(1 + ns.timed_steps)
    row: dict[str, Any] = {"decode_step_ms": 1e3 * (many - one) / ns.timed_steps}
    warm = 4  # decode steps before the profiled ones (the batch fills, the first replays)
    with tempfile.TemporaryDirectory(prefix="shoal-trace-") as tmp:
        trace = Path(tmp) / "trace.json"
        with profile(activities=activities) as prof:
            gen(1 + warm + ns.profiled_steps + 2)
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
        if ns.trace_dir:
            dst = Path(ns.trace_dir) / f"trace_{mode}_fusion{os.environ.get(FUSION_ENV, '1')}_bs{bs}.json"
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(trace.read_text())
    row["profile"] = breakdown(events, steps=ns.profiled_steps, drop_last=2).as_dict()
    return row


# ---- parent: every configuration, one table, one JSON ------------------------------------------------
def run_config(ns: argparse.Namespace, mode: str, backend: str, fusion: str, tmp: Path,
               argv: Sequence[str]) -> dict[str, Any]:
    out = tmp / f"{mode}_{backend}_{fusion}.json"
    cmd = [sys.executable, "-m", "benchmarks.profile_decode", *argv, "--attention-backend", backend,
           "--child", mode, "--output-file", str(out)]
    env = os.environ | {FUSION_ENV: fusion}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ns.timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"timed out after {ns.timeout:.0f} s", "log_tail": str(exc.stdout or "")[-3000:]}
    if proc.returncode != 0 or not out.is_file():
        return {"error": f"exit {proc.returncode}", "log_tail": (proc.stdout + proc.stderr)[-3000:]}
    res = json.loads(out.read_text())
    res["wall_s"] = time.perf_counter() - t0
    return res


def _child_argv(ns: argparse.Namespace) -> list[str]:
    argv = ["--model-config", ns.model_config, "--batch", *map(str, ns.batch),
            "--input-len", str(ns.input_len), "--timed-steps", str(ns.timed_steps),
            "--profiled-steps", str(ns.profiled_steps)]
    return argv + (["--trace-dir", str(Path(ns.trace_dir).resolve())] if ns.trace_dir else [])


def summarize(results: dict[str, Any]) -> tuple[dict[str, Any], dict[str, StepBreakdown]]:
    """{config: decode ms, trace step ms, gaps, kernels} and the breakdowns by column name."""
    summary: dict[str, Any] = {}
    columns: dict[str, StepBreakdown] = {}
    for key, res in results.items():
        if "error" in res:
            summary[key] = {"error": res["error"]}
            continue
        for bs, row in res["batches"].items():
            name = f"{key}/bs{bs}"
            prof = row["profile"]
            bd = StepBreakdown(**{k: prof[k] for k in StepBreakdown.__slots__})
            columns[name] = bd
            # The profiler slows the host a little: the gap against the unprofiled step is the one to quote.
            summary[name] = {"decode_step_ms": row["decode_step_ms"], "trace_step_ms": bd.step_ms,
                             "busy_ms": bd.busy_ms, "gap_ms": bd.gap_ms,
                             "gap_vs_unprofiled_ms": row["decode_step_ms"] - bd.busy_ms if bd.steps else None,
                             "kernels_per_step": bd.kernels_per_step,
                             "category_ms": {c: v["ms"] for c, v in bd.categories.items()}}
    return summary, columns


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    if ns.child:
        run_child(ns, ns.child, Path(ns.output_file))
        return {}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-profile-") as tmp:
        backends = ns.attention_backend.split(",")
        for mode in ns.modes.split(","):
            for backend in backends:
                for fusion in FUSION[ns.fusion]:
                    key = (f"{mode}/" + (f"{backend}/" if len(backends) > 1 else "")
                           + f"fusion_{'on' if fusion == '1' else 'off'}")
                    results[key] = run_config(ns, mode, backend, fusion, Path(tmp), _child_argv(ns))
                    res = results[key]
                    print(key, "error: " + res["error"] if "error" in res else
                          f"done in {res['wall_s']:.0f} s ({res.get('attention_backend')} attention)", flush=True)
                    if "error" in res:
                        print(res["log_tail"], flush=True)
    summary, columns = summarize(results)
    groups: dict[str, dict[str, StepBreakdown]] = {}
    for name, bd in columns.items():  # one table per mode (and backend): fusion off/on x batch sizes
        prefix, _, rest = name.partition("/fusion_")
        groups.setdefault(prefix, {})["fusion_" + rest] = bd
    for prefix, cols in groups.items():
        print(f"== {prefix} ==")
        print(format_table(cols, {"fusion_" + k.partition("/fusion_")[2]: v["decode_step_ms"]
                                  for k, v in summary.items() if k.startswith(prefix + "/fusion_")
                                  and "decode_step_ms" in v}))
    for name, bd in columns.items():
        if bd.note:
            print(f"{name}: {bd.note}")
        elif name.endswith("/bs1"):  # the full list (top 40) is in the JSON
            print(f"-- {name}: top kernels (us/step, calls/step)")
            for k in bd.kernels[:10]:
                print(f"   {k['us_per_step']:8.1f} {k['calls_per_step']:5.0f}  {k['category']:<11} {k['name'][:90]}")
    if ns.output_file:
        write_result(ns.output_file, "profile_decode", results | {"summary": summary}, vars(ns),
                     argv=sys.argv if argv is None else ["profile_decode.py", *argv])
    return results | {"summary": summary}


if __name__ == "__main__":
    main()
