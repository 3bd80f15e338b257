"""4-bit weight-only GEMM (kernels/w4a16_gemm.py) against bf16 torch.matmul on Llama-3.1-8B's four linear
shapes (TP 1, group size 128, zero points as AWQ stores them), M in {1, 16, 64, 256}: device time per call,
achieved GB/s of weight bytes (int4: N*K/2 plus scales and zeros; bf16: 2*N*K) and the 32-layer sum per M
(a decode or prefill step's linear-layer time). Every output is checked against the fp32 reference.

Timed as production runs it: a CUDA graph of >= 32 calls, replayed, timed with CUDA events; the calls
rotate over enough weight copies (>= 256 MB) that L2 holds none of them. `--sweep` also times a grid of
kernel configs per shape and M and reports the best beside pick_config's choice.

    python -m benchmarks.bench_w4a16_gemm --sweep --output-file benchmarks/results/w4a16_gemm_h200.json

`--smoke` runs tiny shapes on CPU in the Triton interpreter (plumbing only; its timings mean nothing)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.bench_fp8_gemv import Timer
from benchmarks.common import kernel_bench_device, print_table, write_result
from benchmarks.config_sweep import time_configs

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_SHAPES = {"qkv": (96, 256), "o": (64, 256), "gate_up": (160, 256), "down": (64, 512)}
LAYERS = 32
GROUP = 128
ROTATE_BYTES = 256 << 20
METHODS = ("bf16_matmul", "w4a16", "dequant_matmul")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--sweep", action="store_true", help="also time a grid of kernel configs per shape and M")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes; on CPU through the Triton interpreter")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def sweep_configs(m: int) -> list[Any]:
    from kernels.w4a16_gemm import W4Config

    if m == 1:
        return [W4Config(1, bn, 128, s, w, 3) for bn in (32, 64, 128) for s in (1, 2, 4, 8) for w in (4, 8)
                if not (bn == 128 and w == 4)]
    if m <= 4:  # the GEMV over a few rows against pick_config's tl.dot
        bm = 1 << (m - 1).bit_length()
        return [W4Config(bm, bn, 128, s, 4, 3, gemv=True) for bn in (32, 64) for s in (4, 8)] + [
            W4Config(16, 64, 128, 4, 4, 4)]
    if m <= 16:
        return [W4Config(16, bn, bk, s, 4, 4, planes=p) for bn in (32, 64, 128) for s in (1, 2, 4)
                for bk, p in ((128, False), (64, False), (128, True))]
    return [W4Config(bm, bn, 128, s, w, st, planes=p) for bm in (64, 128) for bn in (64, 128) for s in (1, 2)
            for w, st in ((4, 4), (8, 3)) for p in (False, True) if bm <= max(64, m)]


def bench_shape(n: int, k: int, ms: list[int], timer: Timer, sweep: bool, device: Any) -> dict[str, Any]:
    import torch

    from kernels.w4a16_gemm import (
        DEQUANT_MATMUL_M,
        pack_int4,
        pick_config,
        w4_dequantize,
        w4a16_gemm,
        w4a16_gemm_ref,
    )

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    gen = torch.Generator(device=device).manual_seed(0)
    qw0 = pack_int4(torch.randint(0, 16, (n, k), generator=gen, device=device))
    scales = (torch.rand(k // GROUP, n, generator=gen, device=device) * 0.002 + 0.001).half()
    zeros = torch.randint(4, 12, (k // GROUP, n), generator=gen, device=device, dtype=torch.uint8)
    w16_0 = ((torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype))
    int4_bytes = n * k // 2 + scales.numel() * 2 + zeros.numel()
    copies = 1 if device.type != "cuda" else max(2, math.ceil(ROTATE_BYTES / int4_bytes))
    qws = [qw0] + [qw0.clone() for _ in range(copies - 1)]
    w16s = [w16_0] + [w16_0.clone() for _ in range(max(1, math.ceil(ROTATE_BYTES / (2 * n * k))) - 1)]
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    out: dict[str, Any] = {"n": n, "k": k, "int4_bytes": int4_bytes, "bf16_bytes": 2 * n * k, "by_m": {}}
    for m in ms:
        x = torch.randn(m, k, generator=gen, device=device).to(dtype)
        ref = w4a16_gemm_ref(x, qw0, scales, zeros, GROUP).float()
        ref_scale = float(ref.abs().max())
        cfg = pick_config(m, n, k, GROUP, sms)
        row: dict[str, Any] = {"pick_config": "dequant_matmul" if m > DEQUANT_MATMUL_M else _cfg_dict(cfg)}
        methods = {
            "bf16_matmul": ([lambda w=w, x=x: torch.matmul(x, w.t()) for w in w16s], 2 * n * k, None),
            "w4a16": ([lambda q=q, x=x: w4a16_gemm(x, q, scales, zeros, GROUP) for q in qws], int4_bytes, ref),
            # what the dispatch takes above DEQUANT_MATMUL_M, timed at every M
            "dequant_matmul": ([lambda q=q, x=x: torch.matmul(x, w4_dequantize(q, scales, zeros, GROUP, dtype).t())
                                for q in qws], int4_bytes, ref),
        }
        for name, (calls, nbytes, want) in methods.items():
            s = timer(calls)
            row[name] = {"us": s * 1e6, "GB_s": nbytes / s / 1e9}
            if want is not None:
                row[name]["max_rel_err"] = float((calls[0]().float() - want).abs().max()) / ref_scale
        row["speedup_vs_bf16"] = row["bf16_matmul"]["us"] / row["w4a16"]["us"]
        if sweep:
            row["sweep"] = time_configs(
                sweep_configs(m),
                lambda c, x=x: [lambda q=q: w4a16_gemm(x, q, scales, zeros, GROUP, config=c) for q in qws],
                ref, timer, _cfg_dict)
            row["sweep_best"] = min(row["sweep"], key=lambda r: r.get("us", math.inf))
        out["by_m"][m] = row
    return out


def _cfg_dict(cfg: Any) -> dict[str, Any]:
    return {"block_m": cfg.block_m, "block_n": cfg.block_n, "block_k": cfg.block_k, "split_k": cfg.split_k,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "planes": cfg.planes, "gemv": cfg.gemv}


def summarize(shapes: dict[str, Any], ms: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in ms:
        for method in METHODS:
            out[f"m{m}_{method}_32layers_ms"] = LAYERS * sum(s["by_m"][m][method]["us"] for s in shapes.values()) / 1e3
        if all("sweep_best" in s["by_m"][m] for s in shapes.values()):
            out[f"m{m}_w4a16_sweep_best_32layers_ms"] = LAYERS * sum(
                s["by_m"][m]["sweep_best"].get("us", math.nan) for s in shapes.values()) / 1e3
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
            print(f"{name:8s} N={n:6d} K={k:6d} M={m:4d}  " + "  ".join(
                f"{meth} {r[meth]['us']:8.1f} us {r[meth]['GB_s']:6.0f} GB/s" for meth in METHODS)
                + f"  x{r['speedup_vs_bf16']:.2f}"
                + (f"  sweep best {r['sweep_best'].get('us', math.nan):.1f} us {r['sweep_best']}"
                   if "sweep_best" in r else ""), flush=True)
    results = {"shapes": shapes, "summary": summarize(shapes, args.m)}
    print_table("w4a16 vs bf16 (32-layer linear time per step)", list(results["summary"].items()))
    if args.output_file:
        write_result(args.output_file, "w4a16_gemm", results,
                     {"m": args.m, "sweep": args.sweep, "replays": args.replays, "smoke": args.smoke, "group": GROUP,
                      "shapes": {s: shapes_in[s] for s in args.shapes}, "rotate_bytes": ROTATE_BYTES},
                     argv=["benchmarks/bench_w4a16_gemm.py", *(argv if argv is not None else sys.argv[1:])])
    return results


if __name__ == "__main__":
    main()
