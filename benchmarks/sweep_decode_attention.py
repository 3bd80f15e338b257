"""Launch configs of our Triton decode kernel over an FP8 (default) or bf16 KV pool, against flashinfer's
tensor-core decode (what the flashinfer backend runs for DECODE), at the batch x context of a KV-bound
serving run (1000/1000 x 1000: ~256 requests at ~1500 tokens) and a mid-size one. Grid: splits {1, 2, 4, 8}
x tile {64, 128} tokens x (warps, stages) {(4, 2), (4, 3), (8, 3), (8, 4)} x math {bf16, fp16} (bf16 alone
over a bf16 pool: rounding bf16 to fp16 is not exact); each a CUDA graph of 32 layer calls over 32 KV
buffers (as benchmarks/bench_decode_attention.py), with its max |difference| from flashinfer's output.
Picked from it: runtime/attention/triton_decode.DecodeKernelConfig.for_kv(fp8).

    python -m benchmarks.sweep_decode_attention --output-file benchmarks/results/decode_attention_fp8_sweep_h100.json
    python -m benchmarks.sweep_decode_attention --kv-dtype bfloat16 --cases 256x400 128x600 32x800

--layouts contiguous decode random (bench_decode_attention.DecodeCase.make's slot layouts), --grid-orders
batch heads (heads: a request's KV-head programs launched next to each other) and --kv-sides n m (the
dots' two forms, kernels/decode_attention.py's kv_rows_m) run every config per variant; --configs limits
the sweep to the named configs (keys as in the output, e.g. s1_bn128_w4_st5_f16; any stages, past the grid's).

GPU only (flashinfer)."""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.bench_decode_attention import DecodeCase, graph_us
from benchmarks.common import write_result

SPLITS, TILES, WARPS_STAGES = (1, 2, 4, 8), (64, 128), ((4, 2), (4, 3), (8, 3), (8, 4))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["256x1500", "64x2048"], help="batch x context")
    p.add_argument("--heads", default="32/8", help="q/kv heads per rank")
    p.add_argument("--kv-dtype", default="float8_e4m3fn", choices=["float8_e4m3fn", "bfloat16"])
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--layouts", nargs="+", default=["contiguous"], choices=["contiguous", "decode", "random"])
    p.add_argument("--grid-orders", nargs="+", default=["batch"], choices=["batch", "heads"])
    p.add_argument("--kv-sides", nargs="+", default=["n"], choices=["n", "m"],
                   help="K/V tiles as the dots' N side (scores [heads, tokens]) or M side ([tokens, heads])")
    p.add_argument("--configs", nargs="+", default=None, type=parse_config,
                   help="only these configs, any s{splits}_bn{tile}_w{warps}_st{stages}_{bf16|f16} (default: the grid; "
                   "--tiles applies to the grid only)")
    p.add_argument("--tiles", type=int, nargs="+", default=list(TILES))
    p.add_argument("--v-perm", type=int, nargs="+", default=[0], choices=[0, 1],
                   help="1: decode_attention_fwd's v_perm (FP8, N side), key _vperm")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def parse_config(key: str) -> tuple[int, int, int, int, bool]:
    """s1_bn128_w4_st5_f16 → (splits, tile, warps, stages, fp16 math); configs past the grid are allowed (the
    grid's stages stop at 4, where the KV loop, any form, still keeps one shared buffer per K/V tile)."""
    m = re.fullmatch(r"s([1-9]\d*)_bn(16|32|64|128|256)_w(1|2|4|8)_st([1-9])_(bf16|f16)", key)
    if m is None:
        raise argparse.ArgumentTypeError(f"config {key!r} is not s{{splits}}_bn{{tile}}_w{{warps}}_st{{stages}}_"
                                         "{bf16|f16}")
    return int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5] == "f16"


def sweep_case(hq: int, hkv: int, bs: int, ctx: int, replays: int, kv_dtype: str, layout: str = "contiguous",
               grid_orders: Sequence[str] = ("batch",),
               configs: Sequence[tuple[int, int, int, int, bool]] | None = None,
               tiles: Sequence[int] = TILES, kv_sides: Sequence[str] = ("n",),
               v_perms: Sequence[int] = (0,)) -> dict[str, Any]:
    import torch
    from triton.runtime.errors import OutOfResources

    case = DecodeCase.make(hq, hkv, getattr(torch, kv_dtype), bs, ctx, layout=layout)
    maths = (False, True) if case.kv_dtype.itemsize == 1 else (False,)
    mb = case.kv_mb_per_layer
    row: dict[str, Any] = {"kv_MB_per_layer": mb}
    flashinfer_layers = case.flashinfer_layers(tensor_cores=True)
    row["flashinfer_us"] = graph_us(flashinfer_layers, replays)
    flashinfer_layers()
    torch.cuda.synchronize()
    ref = case.o.float().clone()
    best: tuple[str, float] | None = None
    grid = configs if configs is not None else [
        (s, t, w, st, f16) for s, t, (w, st), f16 in itertools.product(SPLITS, tiles, WARPS_STAGES, maths)]
    for (splits, tile, warps, stages, f16), order, side, v_perm in itertools.product(grid, grid_orders, kv_sides,
                                                                                      v_perms):
        if f16 and case.kv_dtype.itemsize != 1:
            continue  # rounding a 16-bit pool to fp16 is not exact
        if v_perm and (case.kv_dtype.itemsize != 1 or side != "n"):
            continue
        key = f"s{splits}_bn{tile}_w{warps}_st{stages}_{'f16' if f16 else 'bf16'}"
        key += ("_heads_first" if order == "heads" else "") + ("_kv_m" if side == "m" else "")
        key += "_vperm" if v_perm else ""
        layers = case.triton_layers(splits, block_n=tile, num_warps=warps, num_stages=stages, f16_math=f16,
                                    heads_first=order == "heads", kv_rows_m=side == "m",
                                    v_perm=bool(v_perm))
        try:
            us = graph_us(layers, replays)
        except OutOfResources as e:  # a config past the GPU's shared memory is reported, not fatal
            row[key] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        layers()
        torch.cuda.synchronize()
        row[key] = {"us": us, "TB_per_s": mb / us,
                    "max_abs_diff_vs_flashinfer": float((case.o.float() - ref).abs().max())}
        if best is None or us < best[1]:
            best = (key, us)
        print(key, round(us, 1), flush=True)
    if best is None:
        raise SystemExit(f"no config applies to a {case.kv_dtype} pool (fp16 math and v_perm need an FP8 one)")
    row["best"] = {"config": best[0], "us": best[1], "TB_per_s": mb / best[1],
                   "flashinfer_TB_per_s": mb / row["flashinfer_us"]}
    return row


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("sweep_decode_attention needs a CUDA GPU with flashinfer")
    hq, hkv = (int(x) for x in args.heads.split("/"))
    results: dict[str, Any] = {}
    for case in args.cases:
        bs, ctx = (int(x) for x in case.split("x"))
        for layout in args.layouts:
            name = f"bs{bs} ctx{ctx}" + ("" if layout == "contiguous" else f" {layout}")
            results[name] = sweep_case(hq, hkv, bs, ctx, args.replays, args.kv_dtype, layout, args.grid_orders,
                                       args.configs, args.tiles, args.kv_sides, args.v_perm)
            print(name, results[name]["best"], flush=True)
            torch.cuda.empty_cache()
    if args.output_file:
        keys = None if args.configs is None else [f"s{s}_bn{t}_w{w}_st{st}_{'f16' if f16 else 'bf16'}"
                                                  for s, t, w, st, f16 in args.configs]
        write_result(args.output_file, "sweep_decode_attention", results, {**vars(args), "configs": keys},
                     argv=["benchmarks/sweep_decode_attention.py", *(argv if argv is not None else sys.argv[1:])])
    return results


if __name__ == "__main__":
    main()
