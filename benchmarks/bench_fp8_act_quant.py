"""FP8 linears above the GEMV's M (M > 16: batched decode, prefill): the per-token activation quantize as
the torch ops ran it (x.float, abs, amax, clamp, scale, divide, clamp, fp8 cast: 8 launches) against the
one-launch Triton kernel (kernels/fp8_act_quant.py), alone and with torch._scaled_mm after it, on
Llama-3.1-8B's four linears; the down projection's input is the MLP's gate_up, so its torch form also runs
silu_and_mul and its kernel form folds it (gated). Each row says whether both give the same bits, the
device time per call, and the 32-layer sum per M (the decode step's share).

Timed as production runs it: a CUDA graph of >= 32 calls replayed, CUDA events (bench_fp8_gemv's Timer).

    python -m benchmarks.bench_fp8_act_quant --output-file benchmarks/results/fp8_act_quant_h100.json

On CPU, `--smoke` runs tiny shapes in the Triton interpreter (plumbing and bit-equality; timings mean
nothing)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.bench_fp8_gemv import LAYERS, Timer
from benchmarks.common import kernel_bench_device, print_table, write_result

# name: (N, K, gated input)
SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (28672, 4096, False),
          "down": (4096, 14336, True)}
SMOKE_SHAPES = {"qkv": (96, 64, False), "o": (64, 64, False), "gate_up": (160, 64, False), "down": (64, 128, True)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[32, 64, 256, 2048])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes; on CPU through the Triton interpreter")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def bench_shape(n: int, k: int, gated: bool, ms: list[int], timer: Timer, device: Any) -> dict[str, Any]:
    import torch

    from kernels.activation import silu_and_mul
    from kernels.fp8_act_quant import quantize_per_token_fp8
    from runtime.layers.fp8_linear import _quantized_matmul, quantize_per_channel, quantize_per_token

    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    w8, ws = quantize_per_channel(torch.randn(n, k, generator=gen, device=device).mul_(0.02))
    out: dict[str, Any] = {"n": n, "k": k, "gated": gated, "by_m": {}}
    for m in ms:
        x = torch.randn(m, 2 * k if gated else k, generator=gen, device=device).to(dtype)

        def torch_quant(x: torch.Tensor = x) -> tuple[torch.Tensor, torch.Tensor]:
            return quantize_per_token(silu_and_mul(x) if gated else x)

        def kernel_quant(x: torch.Tensor = x) -> tuple[torch.Tensor, torch.Tensor]:
            return quantize_per_token_fp8(x, gated=gated)

        def linear(quant: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], torch.Tensor]:
            return lambda: _quantized_matmul(*quant(), w8, ws, dtype, None)

        (q0, s0), (q1, s1) = torch_quant(), kernel_quant()
        row: dict[str, Any] = {"bit_equal": bool(torch.equal(q0.view(torch.uint8), q1.view(torch.uint8))
                                                 and torch.equal(s0, s1))}
        for name, fn in {"torch_quant": torch_quant, "kernel_quant": kernel_quant,
                         "torch_quant_scaled_mm": linear(torch_quant),
                         "kernel_quant_scaled_mm": linear(kernel_quant)}.items():
            row[name + "_us"] = timer([fn]) * 1e6
        row["linear_bit_equal"] = bool(torch.equal(linear(torch_quant)(), linear(kernel_quant)()))
        out["by_m"][m] = row
    return out


def summarize(shapes: dict[str, Any], ms: list[int]) -> dict[str, Any]:
    """Per M and method: the four linears x 32 layers (ms)."""
    return {f"m{m}_{meth}_32layers_ms": LAYERS * sum(s["by_m"][m][meth + "_us"] for s in shapes.values()) / 1e3
            for m in ms for meth in ("torch_quant", "kernel_quant", "torch_quant_scaled_mm",
                                     "kernel_quant_scaled_mm")}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = kernel_bench_device(args.smoke)
    shapes_in = SMOKE_SHAPES if args.smoke else SHAPES
    timer = Timer(device, args.replays)
    shapes = {}
    for name in args.shapes:
        n, k, gated = shapes_in[name]
        shapes[name] = bench_shape(n, k, gated, args.m, timer, device)
        for m in args.m:
            r = shapes[name]["by_m"][m]
            print(f"{name:8s} N={n:6d} K={k:6d} M={m:5d} bit_equal={r['bit_equal']}  quant torch "
                  f"{r['torch_quant_us']:7.1f} us kernel {r['kernel_quant_us']:7.1f} us | +scaled_mm torch "
                  f"{r['torch_quant_scaled_mm_us']:7.1f} us kernel {r['kernel_quant_scaled_mm_us']:7.1f} us")
    summary = summarize(shapes, args.m)
    print_table("FP8 activation quantize, 32 layers", list(summary.items()))
    results = {"shapes": shapes, "summary": summary}
    if args.output_file:
        write_result(args.output_file, "fp8_act_quant", results, vars(args), argv)
    return results


if __name__ == "__main__":
    main()
