"""moe_align's three forms (kernels/moe_align.py) by pairs: the one-program Triton kernel, the chunked
three-launch form and the torch reference, on Qwen3-30B-A3B's routing (E 128, top 8) and Mixtral's (E 8,
top 2), each timed as a CUDA graph over 8 random routings (bench_fp8_gemv.Timer). What SINGLE_MAX is
picked from; also how much of a decode step's MoE layer the align is.

    python -m benchmarks.bench_moe_align --output-file benchmarks/results/moe_align_h200.json"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from benchmarks.bench_fp8_gemv import Timer
from benchmarks.common import kernel_bench_device, print_table, write_result

ROUTINGS = {"qwen3-30b-a3b": (128, 8), "mixtral-8x7b": (8, 2)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048])
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="M 1 and 40 on CPU through the Triton interpreter")
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    import torch

    device = kernel_bench_device(args.smoke)  # before kernels/ is imported (the interpreter switch)
    from kernels.fused_moe import pick_block_m
    from kernels.moe_align import moe_align, moe_align_torch

    ms = [1, 40] if args.smoke else args.m
    timer = Timer(device, args.replays)
    gen = torch.Generator(device=device).manual_seed(0)
    forms = {"single": lambda i, e, bm: moe_align(i, e, bm, single_max=1 << 30),
             "chunked": lambda i, e, bm: moe_align(i, e, bm, single_max=0),
             "torch": moe_align_torch, "picked": moe_align}
    rows: list[dict[str, Any]] = []
    for name, (e, top_k) in ROUTINGS.items():
        for m in ms:
            routes = [torch.randn(m, e, generator=gen, device=device).topk(top_k).indices for _ in range(8)]
            bm = pick_block_m(m, top_k, e)
            want = moe_align_torch(routes[0], e, bm)
            row: dict[str, Any] = {"model": name, "m": m, "pairs": m * top_k, "block_m": bm}
            for form, f in forms.items():
                got = f(routes[0], e, bm)
                total = int(want[2])
                assert int(got[2]) == total and torch.equal(got[0][:total], want[0][:total]), (name, m, form)
                row[f"{form}_us"] = round(timer([lambda f=f, i=i, e=e, bm=bm: f(i, e, bm) for i in routes]) * 1e6, 2)
            rows.append(row)
    for r in rows:
        print_table(f"{r['model']} M={r['m']}", [(k, v) for k, v in r.items() if k.endswith("_us")])
    result = {"rows": rows}
    if args.output_file:
        write_result(args.output_file, "moe_align", result, vars(args))
    return result


if __name__ == "__main__":
    main()
