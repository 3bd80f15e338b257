"""Where a continuous-batching run's time goes, step by step: every forward's device time (CUDA events
around ModelRunner.forward, so a host stall inside a step counts in it) by forward mode and by
batch-size bucket, for bench_static_vs_continuous's workload (256 requests, input U[64,512], output
U[16,512], EOS ignored) on dummy weights, with the garbage-collector freeze (runtime/gc_guard.py) off and
on, each in its own spawned interpreter.

    python -m benchmarks.svc_step_times --output-file benchmarks/results/svc_step_times_gc_h100.json

On CUDA it also splits the device time outside the forwards (before the first, between, after the last:
`outside_forwards`); `--profile` traces the run and sums kernel time per category, DECODE's graph-replayed
kernels apart from EXTEND's eager ones.

What it found on an H100 (benchmarks/README.md): with start-up objects left in the collector, four
~12 ms decode steps took 100-140 ms and the last 436-621 ms (generation-2 collections stopping the
scheduler thread); frozen, none over 30 ms and the run went 9.29 → 7.22 s."""

from __future__ import annotations

import argparse
import ast
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench_static_vs_continuous import build_workload
from benchmarks.common import load_model_config, make_model_folder, write_result

BUCKET = 32  # decode steps are summed per 32 requests of batch size


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-range", type=int, nargs=2, default=[64, 512])
    p.add_argument("--output-range", type=int, nargs=2, default=[16, 512])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gc-freeze", nargs="+", default=["0", "1"], choices=["0", "1"],
                   help="SHOAL_GC_FREEZE values to run, one spawned process each")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--cuda-graph-max-bs", type=int, default=256)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra Engine argument, e.g. enable_mixed_chunk=True (repeatable)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--profile", action="store_true",
                   help="also trace the run (torch.profiler) and sum kernel time per category, eager "
                        "(EXTEND) and graph-replayed (DECODE) kernels apart; the trace slows the run")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def engine_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """KEY=VALUE → {key: value}, the value read as a Python literal where it is one (True, 2048), else a string."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg {pair!r}: expected KEY=VALUE")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def summarize(rows: list[tuple[str, int, float]]) -> dict[str, Any]:
    """rows: (mode, batch size, device ms) per forward → totals per mode, decode per batch bucket, the
    slowest forwards."""
    modes: dict[str, dict[str, float]] = {}
    buckets: dict[str, dict[str, float]] = {}
    for mode, bs, ms in rows:
        m = modes.setdefault(mode, {"forwards": 0, "s": 0.0})
        m["forwards"] += 1
        m["s"] += ms / 1e3
        if mode == "DECODE":
            lo = (bs - 1) // BUCKET * BUCKET + 1
            b = buckets.setdefault(f"{lo}-{lo + BUCKET - 1}", {"steps": 0, "s": 0.0})
            b["steps"] += 1
            b["s"] += ms / 1e3
    for b in buckets.values():
        b["mean_ms"] = 1e3 * b["s"] / b["steps"]
    slowest = sorted(range(len(rows)), key=lambda i: -rows[i][2])[:12]
    return {"modes": modes, "decode_by_batch": dict(sorted(buckets.items(), key=lambda kv: int(kv[0].split("-")[0]))),
            "slowest": [{"index": i, "mode": rows[i][0], "batch": rows[i][1], "ms": rows[i][2]} for i in slowest]}


def run_one(args: argparse.Namespace, freeze: str) -> dict[str, Any]:
    os.environ["SHOAL_GC_FREEZE"] = freeze  # read when the scheduler host starts, in this fresh interpreter
    import torch

    from runtime import Engine

    # bench_static_vs_continuous's own workload (same seed, lengths and special-token-free ids).
    w = build_workload(args, load_model_config(args.model_config))
    prompts, out_lens = w.prompts, w.output_lens
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model_folder(args.model_config, Path(tmp) / "m")
        engine = Engine(str(folder), load_format="dummy", dtype=args.dtype, device=args.device,
                        cuda_graph_max_bs=args.cuda_graph_max_bs, max_running_requests=args.num_requests,
                        attention_backend=args.attention_backend, log_interval_s=1e9,
                        **engine_overrides(args.engine_arg))
    try:
        runner = engine.worker.runner
        timed: list[tuple[str, int, Any, Any]] = []
        forward = runner.forward
        cuda = runner.device.type == "cuda"

        def timed_forward(fb: Any, **kw: Any) -> Any:
            # CUDA: events in the stream (a host stall between them counts: the device waited); CPU: the
            # forward runs inside the call.
            start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
            if cuda:
                start.record()
            out = forward(fb, **kw)
            end = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
            if cuda:
                end.record()
            timed.append((fb.forward_mode.name, fb.batch_size, start, end))
            return out

        runner.forward = timed_forward
        engine.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 4, "temperature": 0.0,
                                                                "ignore_eos": True})
        timed.clear()
        gc0 = engine.get_stats()
        prof = _profiler(args.profile and cuda)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
        with prof:
            t0 = time.perf_counter()
            if cuda:
                marks[0].record()
            outs = engine.generate(input_ids=prompts, sampling_params=[
                {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in out_lens])
            duration = time.perf_counter() - t0
            if cuda:
                marks[1].record()
                torch.cuda.synchronize()
        stats = engine.get_stats()
        rows = [(mode, bs, start.elapsed_time(end) if cuda else 1e3 * (end - start)) for mode, bs, start, end in timed]
        made = sum(int(o["usage"]["completion_tokens"]) for o in outs)
        return {"duration_s": duration, "useful_tokens": made, "expected_tokens": sum(out_lens),
                "useful_tok_per_s": made / duration, "frozen_objects": engine.host.gc.frozen,
                "gc_pause_s": stats.gc_pause_s - gc0.gc_pause_s,
                "gc_slow_pauses": stats.gc_slow_pauses - gc0.gc_slow_pauses,
                "forward_device_s": sum(r[2] for r in rows) / 1e3, **summarize(rows),
                "forwards": [list(r) for r in rows],
                **({"kernel_profile": kernel_profile(prof)} if args.profile and cuda else {}),
                **({"outside_forwards": outside_forwards(timed, marks)} if cuda and timed else {})}
    finally:
        engine.shutdown()


def outside_forwards(timed: list[tuple[str, int, Any, Any]], marks: list[Any], top: int = 8) -> dict[str, Any]:
    """Device time (ms) outside the forwards: from the call's start to the first forward, between forwards
    (the step's own sampling and copies, and any idle wait for the host), after the last; the largest gaps."""
    gaps = [(i, timed[i - 1][0], timed[i][0], timed[i - 1][3].elapsed_time(timed[i][2])) for i in range(1, len(timed))]
    return {"before_first_ms": marks[0].elapsed_time(timed[0][2]), "between_ms": sum(g[3] for g in gaps),
            "after_last_ms": timed[-1][3].elapsed_time(marks[1]),
            "between_by_pair_ms": {f"{a}->{b}": sum(g[3] for g in gaps if (g[1], g[2]) == (a, b))
                                   for a, b in sorted({(g[1], g[2]) for g in gaps})},
            "largest": [{"index": i, "after": a, "before": b, "ms": ms}
                        for i, a, b, ms in sorted(gaps, key=lambda g: -g[3])[:top]]}


def _profiler(on: bool) -> Any:
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA]) if on else contextlib.nullcontext()


def kernel_profile(prof: Any, top: int = 40) -> dict[str, Any]:
    """Device time per kernel category (ms), kernels replayed by CUDA graphs (the decode steps) apart from
    eager ones (prefill, and the host-side copies between steps), with each side's top kernels."""
    import json

    from benchmarks.trace_breakdown import classify_kernel, device_ops, graph_launch_correlations

    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    ops = device_ops(events)
    graph = graph_launch_correlations(events, ops)
    out: dict[str, Any] = {}
    for side in ("eager", "graph"):
        mine = [op for op in ops if (op.correlation in graph) == (side == "graph")]
        cats: dict[str, float] = {}
        names: dict[str, list[float]] = {}
        for op in mine:
            cats[classify_kernel(op.name)] = cats.get(classify_kernel(op.name), 0.0) + op.dur / 1e3
            n = names.setdefault(op.name[:120], [0, 0.0])
            n[0] += 1
            n[1] += op.dur / 1e3
        out[side] = {"ms": sum(cats.values()), "kernels": len(mine),
                     "categories_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
                     "top": [{"name": k, "calls": int(v[0]), "ms": v[1]}
                             for k, v in sorted(names.items(), key=lambda kv: -kv[1][1])[:top]]}
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    results: dict[str, Any] = {}
    ctx = multiprocessing.get_context("spawn")
    for freeze in args.gc_freeze:
        with ctx.Pool(1) as pool:
            r = pool.apply(run_one, (args, freeze))
        results[f"gc_freeze_{freeze}"] = r
        print(f"SHOAL_GC_FREEZE={freeze}: {r['duration_s']:.3f} s, {r['useful_tok_per_s']:.0f} useful tok/s, "
              f"gc {r['gc_pause_s']:.3f} s ({r['gc_slow_pauses']} slow); slowest forwards "
              f"{[(s['mode'], s['batch'], round(s['ms'], 1)) for s in r['slowest'][:5]]}", flush=True)
    if args.output_file:
        write_result(args.output_file, "svc_step_times", results, vars(args),
                     argv=["benchmarks/svc_step_times.py", *(argv if argv is not None else sys.argv[1:])])
    return results


if __name__ == "__main__":
    main()
