"""16-bit weights at decode-batch M: kernels/decode_gemm.py's tile configs against cuBLAS (torch.matmul) on
Llama-3.1-8B's linear shapes and its LM head. Per (shape, M) it times cuBLAS and every candidate config
(CUDA graphs of >= 32 calls over rotated weight copies, so L2 holds none: bench_fp8_gemv.Timer) and
reports the best, its TFLOP/s and TB/s, and the 32-layer sums per M (cuBLAS, best Triton, best of both):
what a decode step's linears would cost with the table the sweep suggests.

    python -m benchmarks.sweep_decode_gemm --output-file benchmarks/results/decode_gemm_sweep_h100.json

On CPU, `--smoke` runs tiny shapes in the Triton interpreter (plumbing only; timings mean nothing)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.bench_fp8_gemv import LAYER_SHAPES, LAYERS, ROTATE_BYTES, SHAPES, SMOKE_SHAPES, Timer
from benchmarks.common import kernel_bench_device, print_table, write_result

# (block_m, block_n, block_k, warps, stages); swap_ab tiles name block_m the token side as well.
PLAIN_TILES = [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (64, 256, 64, 8, 3),
               (128, 64, 64, 4, 4), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3),
               (256, 64, 64, 8, 3), (256, 128, 64, 8, 3)]
SWAP_TILES = [(16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 128, 4, 4), (32, 128, 64, 4, 4),
              (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 4), (64, 256, 64, 8, 3),
              (128, 256, 64, 8, 3)]
SMEM_LIMIT = 200 * 1024


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[32, 64, 128, 192, 256, 320, 384, 512])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--blas", nargs="+", default=["cublas"], choices=["cublas", "cublaslt"],
                   help="torch.matmul under each torch.backends.cuda.preferred_blas_library")
    p.add_argument("--no-triton", action="store_true", help="time the BLAS libraries only")
    p.add_argument("--sm-count", type=int, default=0, help="0: ask the device")
    p.add_argument("--smoke", action="store_true", help="tiny shapes; on CPU through the Triton interpreter")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def candidates(m: int, n: int, k: int, sm_count: int, smoke: bool = False) -> list[Any]:
    from kernels.decode_gemm import GemmConfig

    if smoke:
        return [GemmConfig(16, 32, 16), GemmConfig(16, 32, 16, split_k=2, swap_ab=True)]
    pm = 1 << (m - 1).bit_length()
    out = []
    for swap, tiles in ((False, PLAIN_TILES), (True, SWAP_TILES)):
        for bm, bn, bk, warps, stages in tiles:
            if bm > max(2 * pm, 16) or bm * 4 < pm:  # no tile far wider than M; at most ~4 M tiles
                continue
            tiles_mn = math.ceil(m / bm) * math.ceil(n / bn)
            for split in (1, 2, 4):
                if split > 1 and (tiles_mn >= sm_count or k % (split * bk)):
                    continue
                cfg = GemmConfig(bm, bn, bk, split_k=split, swap_ab=swap, num_warps=warps, num_stages=stages)
                if cfg.smem_bytes() <= SMEM_LIMIT:
                    out.append(cfg)
    return out


def bench_shape(n: int, k: int, ms: list[int], timer: Timer, device: Any, sm_count: int,
                smoke: bool, blas: Sequence[str] = ("cublas",), triton: bool = True) -> dict[str, Any]:
    import torch

    from kernels.decode_gemm import decode_gemm

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    w0 = torch.randn(n, k, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype)
    copies = 1 if device.type != "cuda" else max(2, math.ceil(ROTATE_BYTES / (2 * n * k)))
    ws = [w0] + [w0.clone() for _ in range(copies - 1)]
    out: dict[str, Any] = {"n": n, "k": k, "weight_bytes": 2 * n * k, "copies": copies, "by_m": {}}
    for m in ms:
        x = torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).to(dtype)
        ref = (x.float() @ w0.float().t())
        ref_scale = float(ref.abs().max())
        flop, nbytes = 2 * m * n * k, 2 * n * k + 2 * m * (n + k)
        row: dict[str, Any] = {}
        for lib in blas:
            if device.type == "cuda":
                torch.backends.cuda.preferred_blas_library(lib)
            s = timer([lambda w=w, x=x: torch.matmul(x, w.t()) for w in ws])
            row[lib] = {"us": s * 1e6, "TFLOP_s": flop / s / 1e12, "TB_s": nbytes / s / 1e12}
        if device.type == "cuda":
            torch.backends.cuda.preferred_blas_library("cublas")
        row.setdefault("cublas", min((row[lib] for lib in blas), key=lambda r: r["us"]))
        rows = []
        for cfg in candidates(m, n, k, sm_count, smoke) if triton else []:
            r: dict[str, Any] = {"block_m": cfg.block_m, "block_n": cfg.block_n, "block_k": cfg.block_k,
                                 "split_k": cfg.split_k, "swap_ab": cfg.swap_ab, "num_warps": cfg.num_warps,
                                 "num_stages": cfg.num_stages}
            calls = [lambda w=w, x=x, cfg=cfg: decode_gemm(x, w, config=cfg) for w in ws]
            try:
                r["max_rel_err"] = float((calls[0]().float() - ref).abs().max()) / ref_scale
                t = timer(calls)
                r.update(us=t * 1e6, TFLOP_s=flop / t / 1e12, TB_s=nbytes / t / 1e12)
            except Exception as e:  # a config the compiler rejects (registers, shared memory) is reported
                r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(r)
        timed = [r for r in rows if "us" in r and r["max_rel_err"] < 2e-2]
        row["best"] = min(timed, key=lambda r: r["us"]) if timed else None
        row["speedup_vs_cublas"] = row["cublas"]["us"] / row["best"]["us"] if timed else None
        row["sweep"] = rows
        out["by_m"][m] = row
        print(f"n={n} k={k} m={m}: " + ", ".join(f"{lib} {row[lib]['us']:.1f} us" for lib in blas)
              + f", best triton {row['best']['us'] if timed else math.nan:.1f} us", file=sys.stderr, flush=True)
    return out


def summarize(shapes: dict[str, Any], ms: list[int], blas: Sequence[str] = ("cublas",)) -> dict[str, Any]:
    """Per M, the 32-layer sum (+ the LM head once when measured) in ms: a decode step's linears, per BLAS
    library, for the best Triton config (None when not swept) and for the faster of the two per shape."""
    out: dict[str, Any] = {}
    for m in ms:
        tot: dict[str, Any] = {lib: 0.0 for lib in blas} | {"triton_best": 0.0, "best_of_both": 0.0}
        for name, s in shapes.items():
            times = s["by_m"][m]
            reps = LAYERS if name in LAYER_SHAPES else 1
            lib_us = min(times[lib]["us"] for lib in blas)
            t = times["best"]["us"] if times["best"] else math.inf
            for lib in blas:
                tot[lib] += reps * times[lib]["us"] / 1e3
            tot["triton_best"] += reps * t / 1e3
            tot["best_of_both"] += reps * min(lib_us, t) / 1e3
        if math.isinf(tot["triton_best"]):
            tot["triton_best"] = None
        out[f"m{m}"] = tot
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = kernel_bench_device(args.smoke)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    ms = [m for m in args.m if not args.smoke or m <= 32]
    sm = args.sm_count or (torch.cuda.get_device_properties(device).multi_processor_count
                           if device.type == "cuda" else 132)
    timer = Timer(device, 1 if args.smoke else args.replays)
    res = {name: bench_shape(*shapes[name], ms, timer, device, sm, args.smoke, args.blas, not args.no_triton)
           for name in args.shapes}
    summary = summarize(res, ms, args.blas)
    cols = [*args.blas, "triton_best", "best_of_both"]
    print_table("decode GEMM, 32 layers + LM head (ms): " + " / ".join(cols),
                [(k, " / ".join("-" if v[c] is None else f"{v[c]:.3f}" for c in cols)) for k, v in summary.items()])
    if args.output_file:
        write_result(args.output_file, "sweep_decode_gemm", {"summary": summary, "shapes": res}, vars(args),
                     argv=["benchmarks/sweep_decode_gemm.py", *(argv if argv is not None else sys.argv[1:])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
