"""FP8 weights at decode-sized M: the w8a16 Triton GEMV (kernels/fp8_gemv.py) against bf16 torch.matmul
and the w8a8 path it replaces (per-token activation quantize + torch._scaled_mm, row-wise scales), and the
same kernel on the bf16 weights (dense_gemv: what DenseGemm serves at M = 1) on Llama-3.1-8B's four linear
shapes and its LM head, M in {1, 2, 4, 8, 16}. Reports device time per call and achieved GB/s of
weight bytes (fp8: N*K, bf16: 2*N*K), and the 32-layer sum per M (the decode step's linear-layer time;
the FP8 step target is <= 3.4 ms in all, issue 16).

Each method is timed as production runs it: a CUDA graph of >= 32 calls, replayed, timed with CUDA events.
The calls rotate over enough weight copies (>= 256 MB) that L2 (50 MB on H100) holds none of them.
`--sweep` also times a grid of kernel configs per shape and reports the best beside pick_config's choice
(to retune pick_config). Every method's output is checked against the fp32 reference.

    python -m benchmarks.bench_fp8_gemv --sweep --output-file benchmarks/results/fp8_gemv_h100.json

On CPU, `--smoke` runs tiny shapes in the Triton interpreter with wall-clock timing (a correctness and
plumbing check; its timings mean nothing)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common import kernel_bench_device, print_table, write_result
from benchmarks.config_sweep import time_configs

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
SMOKE_SHAPES = {"qkv": (96, 64), "o": (64, 64), "gate_up": (160, 64), "down": (64, 128), "lm_head": (200, 64)}
LAYER_SHAPES = ("qkv", "o", "gate_up", "down")  # x 32 layers; the LM head once
METHODS = ("bf16_matmul", "dense_gemv", "w8a8_scaled_mm", "w8a8_fused_quant", "fp8_gemv")
LAYERS = 32
ROTATE_BYTES = 256 << 20


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--shapes", nargs="+", default=list(LAYER_SHAPES), choices=list(SHAPES))
    p.add_argument("--sweep", action="store_true", help="also time a grid of kernel configs per shape")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes; on CPU through the Triton interpreter")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def sweep_configs(m: int) -> list[Any]:
    from kernels.fp8_gemv import GemvConfig

    bm = 1 << (m - 1).bit_length()
    out = [GemvConfig(block_n=bn, block_k=bk, split_k=s, num_warps=w, num_stages=2)
           for bn, bk, w in [(4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 256, 4), (16, 512, 4), (16, 1024, 8),
                             (32, 256, 4)]
           for s in (1, 2) if bm * bn * bk <= 16384]
    out += [GemvConfig(block_n=bn, block_k=bk, split_k=s, use_dot=True, num_warps=w, num_stages=st)
            for bn, bk, st, w in [(16, 256, 4, 4), (16, 512, 3, 4), (32, 256, 4, 4), (32, 128, 5, 4),
                                  (64, 128, 4, 4), (64, 256, 3, 8)]
                                  # wider tiles for 17-64 rows, where each weight tile feeds a whole x tile
                                  + ([(64, 64, 4, 4), (128, 64, 3, 4), (128, 128, 3, 8)] if m > 16 else [])
            for s in (1, 2)]
    return out


class Timer:
    """Seconds per call: a CUDA graph of `calls` (one per rotated weight copy, repeated to >= 32) replayed
    and timed with events on CUDA; a plain wall-clock loop elsewhere."""

    def __init__(self, device: Any, replays: int):
        self.device, self.replays = device, replays

    def __call__(self, calls: list[Callable[[], Any]]) -> float:
        import torch

        for c in calls:  # compile / pick algorithms outside the capture
            c()
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(self.replays):
                for c in calls:
                    c()
            return (time.perf_counter() - t0) / (self.replays * len(calls))
        seq = calls * max(1, math.ceil(32 / len(calls)))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in seq:
                c()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / (self.replays * len(seq))


def w8a8_scaled_mm(x: Any, w8: Any, scale: Any) -> Any:
    """The path the GEMV replaces (runtime/layers/fp8_linear's, with its dispatch bypassed)."""
    import torch

    from runtime.layers.fp8_linear import fp8_linear_reference, quantize_per_token, scaled_mm_supported

    xq, xs = quantize_per_token(x)
    if scaled_mm_supported(x.device, x.dtype):
        return torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    return fp8_linear_reference(xq, xs, w8, scale, x.dtype)


def w8a8_fused_quant(x: Any, w8: Any, scale: Any) -> Any:
    """What serves above the GEMV's rows by default: the one-launch activation quantize, then _scaled_mm."""
    from kernels.fp8_act_quant import quantize_per_token_fp8
    from runtime.layers.fp8_linear import _quantized_matmul

    xq, xs = quantize_per_token_fp8(x)
    return _quantized_matmul(xq, xs, w8, scale, x.dtype, None)


def bench_shape(n: int, k: int, ms: list[int], timer: Timer, sweep: bool, device: Any) -> dict[str, Any]:
    import torch

    from kernels.fp8_gemv import dense_linear_small_m, fp8_linear_small_m, fp8_linear_small_m_ref, pick_config
    from runtime.layers.fp8_linear import quantize_per_channel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's dot needs fp32
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
    w8_0, scale = quantize_per_channel(w)
    w16_0 = w.to(dtype)
    del w
    copies = 1 if device.type != "cuda" else max(2, math.ceil(ROTATE_BYTES / (n * k)))
    w8s = [w8_0] + [w8_0.clone() for _ in range(copies - 1)]
    w16s = [w16_0] + [w16_0.clone() for _ in range(max(1, copies // 2) - 1)]
    out: dict[str, Any] = {"n": n, "k": k, "weight_bytes_fp8": n * k, "copies": copies, "by_m": {}}
    for m in ms:
        x = torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).to(dtype)
        ref = fp8_linear_small_m_ref(x, w8_0, scale).float()
        ref_scale = float(ref.abs().max())
        cfg = pick_config(m, n, k, torch.cuda.get_device_properties(device).multi_processor_count
                          if device.type == "cuda" else 132)
        row: dict[str, Any] = {"pick_config": _cfg_dict(cfg)}
        methods = {
            "bf16_matmul": ([lambda w16=w16, x=x: torch.matmul(x, w16.t()) for w16 in w16s], 2 * n * k),
            "dense_gemv": ([lambda w16=w16, x=x: dense_linear_small_m(x, w16) for w16 in w16s], 2 * n * k),
            "w8a8_scaled_mm": ([lambda w8=w8, x=x: w8a8_scaled_mm(x, w8, scale) for w8 in w8s], n * k),
            "w8a8_fused_quant": ([lambda w8=w8, x=x: w8a8_fused_quant(x, w8, scale) for w8 in w8s], n * k),
            "fp8_gemv": ([lambda w8=w8, x=x, cfg=cfg: fp8_linear_small_m(x, w8, scale, config=cfg) for w8 in w8s], n * k),
        }
        for name, (calls, nbytes) in methods.items():
            err = float((calls[0]().float() - ref).abs().max()) / ref_scale
            s = timer(calls)
            row[name] = {"us": s * 1e6, "GB_s": nbytes / s / 1e9, "max_rel_err_vs_w8a16_ref": err}
        if sweep:
            row["sweep"] = time_configs(
                sweep_configs(m), lambda c, x=x: [lambda w8=w8: fp8_linear_small_m(x, w8, scale, config=c)
                                                  for w8 in w8s],
                ref, timer, _cfg_dict, n * k)
            row["sweep_best"] = min(row["sweep"], key=lambda r: r.get("us", math.inf))
        out["by_m"][m] = row
    return out


def _cfg_dict(cfg: Any) -> dict[str, Any]:
    return {"block_n": cfg.block_n, "block_k": cfg.block_k, "split_k": cfg.split_k, "use_dot": cfg.use_dot,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def summarize(shapes: dict[str, Any], ms: list[int]) -> dict[str, Any]:
    """Per M: the layer shapes' sum x 32 layers (+ the LM head when measured), per method (ms) — a decode
    step's linear layers."""
    out: dict[str, Any] = {}
    for m in ms:
        for method in METHODS:
            out[f"m{m}_{method}_32layers_ms"] = sum(
                (LAYERS if name in LAYER_SHAPES else 1) * s["by_m"][m][method]["us"] for name, s in shapes.items()) / 1e3
        if all("sweep_best" in s["by_m"][m] for s in shapes.values()):
            out[f"m{m}_fp8_gemv_sweep_best_32layers_ms"] = sum(
                (LAYERS if name in LAYER_SHAPES else 1) * s["by_m"][m]["sweep_best"].get("us", math.nan)
                for name, s in shapes.items()) / 1e3
    fp8_bytes = sum((LAYERS if name in LAYER_SHAPES else 1) * s["weight_bytes_fp8"] for name, s in shapes.items())
    out["fp8_weight_bytes_32layers"] = fp8_bytes
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = kernel_bench_device(args.smoke)
    shapes_in = SMOKE_SHAPES if args.smoke else SHAPES
    timer = Timer(device, args.replays)
    shapes = {}
    for name in args.shapes:
        n, k = shapes_in[name]
        shapes[name] = bench_shape(n, k, args.m, timer, args.sweep, device)
        for m in args.m:
            r = shapes[name]["by_m"][m]
            print(f"{name:8s} N={n:6d} K={k:6d} M={m:3d}  " + "  ".join(
                f"{meth} {r[meth]['us']:8.1f} us {r[meth]['GB_s']:7.0f} GB/s" for meth in
                METHODS)
                + (f"  sweep best {r['sweep_best'].get('us', math.nan):.1f} us" if "sweep_best" in r else ""),
                flush=True)
    results = {"shapes": shapes, "summary": summarize(shapes, args.m)}
    print_table("fp8 gemv (32-layer linear time per decode step)", list(results["summary"].items()))
    if args.output_file:
        write_result(args.output_file, "fp8_gemv", results,
                     {"m": args.m, "sweep": args.sweep, "replays": args.replays, "smoke": args.smoke,
                      "shapes": {s: shapes_in[s] for s in args.shapes}, "rotate_bytes": ROTATE_BYTES},
                     argv=["benchmarks/bench_fp8_gemv.py", *(argv if argv is not None else sys.argv[1:])])
    return results


if __name__ == "__main__":
    main()
