"""Block-wise FP8 (Qwen3-*-FP8's weight_block_size [128, 128]) on the GPU: the Triton group quantize gives
the torch reference's bits (plain and with SiLU-and-mul), the block-scaled GEMM matches dequantize-then-
matmul on Qwen3-8B's layer shapes at M = 1, 4, 16, 256, 2048 (GEMV and MMA kernels); an Engine serves a block-FP8 checkpoint greedily
under CUDA graphs, against the same weights dequantized to bf16; and a micro-benchmark of bf16 F.linear vs
the block-FP8 linear (quantize + GEMM) per layer shape (JSON to $SHOAL_FP8_BLOCK_BENCH_OUT when set;
SHOAL_FP8_BLOCK_SWEEP=1 also times alternative tiles)."""

from __future__ import annotations

import json
import os
import platform
import random
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from gpu_models import LLAMA_4L, save_bf16_llama

sys.path.insert(0, str(Path(__file__).parents[1] / "quant_fp8"))
from block_fp8_checkpoints import quantize_blocks, write_block_fp8_checkpoint  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

DT = torch.bfloat16
BLOCK = (128, 128)
# Qwen3-8B (hidden 4096, 32 q / 8 kv heads of 128, intermediate 12288): (N, K) of each projection
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def _sm89() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


def _layer(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    w8, scale = quantize_blocks(w, BLOCK)
    return w.to(DT), w8, scale


@pytest.mark.parametrize("m", [1, 4, 16, 256, 2048])
@pytest.mark.parametrize("shape", ["qkv", "down"])
def test_kernels_match_reference(m: int, shape: str) -> None:
    from kernels.activation import silu_and_mul
    from kernels.fp8_block_gemm import (
        SCALED_MM_MIN_M,
        blockwise_scaled_mm_available,
        per_token_group_quant_fp8,
        per_token_group_quant_ref,
        scaled_mm_takes,
        w8a8_block_fp8_matmul,
        w8a8_block_fp8_matmul_ref,
    )
    from runtime.layers.fp8_block_linear import fp8_block_linear

    if not _sm89():
        pytest.skip("the block kernels need sm89+ (e4m3)")
    n, k = SHAPES[shape]
    w, w8, scale = _layer(n, k)
    x = torch.randn(m, k, device="cuda", dtype=DT)
    x[:, 7] *= 30.0  # an outlier: only its group's scale grows
    xq, xs = per_token_group_quant_fp8(x, BLOCK[1])
    rq, rs = per_token_group_quant_ref(x, BLOCK[1])
    assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(xs, rs)
    gate_up = torch.randn(m, 2 * k, device="cuda", dtype=DT)
    gq, gs = per_token_group_quant_fp8(gate_up, BLOCK[1], gated=True)
    hq, hs = per_token_group_quant_ref(silu_and_mul(gate_up), BLOCK[1])
    assert torch.equal(gq.view(torch.uint8), hq.view(torch.uint8)) and torch.equal(gs, hs)
    got = w8a8_block_fp8_matmul(xq, xs, w8, scale, BLOCK, DT).float()
    ref = w8a8_block_fp8_matmul_ref(xq, xs, w8, scale, BLOCK, torch.float32)
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))  # bf16 output rounding
    exact = x.float() @ w.float().t()
    assert float((got - exact).norm() / exact.norm()) < 0.05
    if m >= SCALED_MM_MIN_M and blockwise_scaled_mm_available(x.device) and scaled_mm_takes(w8, BLOCK):
        cublas = fp8_block_linear(x, w8, scale, BLOCK, None, True, scaled_mm=True).float()
        torch.testing.assert_close(cublas, ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


@pytest.fixture(scope="module")
def block_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """LLAMA_4L (head_dim 128, intermediate 2816 = 22 blocks) as a [128, 128] block-FP8 checkpoint and its
    dequantized twin."""
    root = tmp_path_factory.mktemp("gpu_block_llama")
    src = save_bf16_llama(root / "src", LLAMA_4L)
    return write_block_fp8_checkpoint(src, root, BLOCK)


def test_engine_block_fp8_greedy_under_cuda_graphs(block_llama: tuple[Path, Path]) -> None:
    """Greedy runs (CUDA graphs on, 16 prompts, batch sizes through the graphs) of the block-FP8 checkpoint
    and of its dequantized bf16 twin: every request completes, the KV pool is whole again, and first tokens
    mostly agree (random weights: near-ties)."""
    from runtime import Engine

    if not _sm89():
        pytest.skip("the block kernels need sm89+ (e4m3)")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randrange(16, 300))] for _ in range(16)]
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    runs = {}
    for name, path in zip(("fp8", "bf16"), block_llama, strict=True):
        with Engine(model_path=str(path), dtype="bfloat16", max_total_tokens=32768, cuda_graph_max_bs=32,
                    context_length=1024) as engine:
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            assert engine.get_stats().num_used_tokens == 0
        assert all(len(o["output_ids"]) == 24 for o in outs)
        runs[name] = [o["output_ids"] for o in outs]
    first = sum(a[0] == b[0] for a, b in zip(runs["bf16"], runs["fp8"], strict=True))
    tokens = sum(x == y for a, b in zip(runs["bf16"], runs["fp8"], strict=True) for x, y in zip(a, b, strict=True))
    print(f"block fp8 vs dequantized bf16: first tokens {first}/16, all tokens {tokens}/{16 * 24}")
    assert first >= 9, first


def _time_us(fn) -> float:
    import triton

    return 1000.0 * triton.testing.do_bench_cudagraph(fn, rep=50)


def _cfg(kind: str, bm: int, bn: int, bk: int, warps: int, stages: int, m: int) -> dict[str, int]:
    if kind == "gemv":
        return dict(GEMV=1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWIZZLE_M=8 if m >= 256 else 1, num_warps=warps,
                num_stages=stages)


SWEEP = {  # (kernel, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) timed per M with SHOAL_FP8_BLOCK_SWEEP=1
    1: [("gemv", 1, 8, 1024, 4, 1), ("gemv", 1, 16, 512, 4, 1), ("gemv", 1, 4, 1024, 4, 1),
        ("gemv", 1, 8, 512, 4, 1), ("gemv", 1, 16, 1024, 8, 1), ("gemv", 1, 8, 2048, 8, 1),
        ("mma", 16, 64, 128, 4, 6)],
    4: [("gemv", 4, 4, 256, 4, 1), ("gemv", 4, 8, 256, 4, 1), ("gemv", 4, 4, 512, 4, 1), ("gemv", 4, 2, 512, 4, 1),
        ("gemv", 4, 8, 128, 4, 1), ("mma", 16, 32, 128, 4, 4), ("mma", 16, 64, 128, 4, 6)],
    16: [("gemv", 16, 2, 256, 4, 1), ("gemv", 16, 4, 128, 4, 1), ("mma", 16, 16, 128, 2, 4),
         ("mma", 16, 32, 128, 2, 5), ("mma", 16, 32, 128, 4, 4), ("mma", 16, 64, 128, 4, 6)],
    64: [("mma", 32, 64, 128, 4, 4), ("mma", 64, 64, 128, 4, 4), ("mma", 64, 64, 128, 4, 5),
         ("mma", 64, 128, 128, 4, 3), ("mma", 64, 32, 128, 4, 4)],
    256: [("mma", 64, 64, 128, 4, 4), ("mma", 64, 128, 128, 4, 3), ("mma", 64, 128, 128, 4, 4),
          ("mma", 128, 64, 128, 4, 4), ("mma", 64, 64, 128, 4, 5)],
    2048: [("mma", 64, 128, 128, 4, 4), ("mma", 64, 128, 128, 4, 5), ("mma", 128, 128, 128, 8, 3),
           ("mma", 128, 128, 128, 8, 4), ("mma", 128, 64, 128, 4, 4), ("mma", 64, 256, 128, 8, 3)],
}
M_LIST = (1, 4, 16, 64, 256, 2048)


def test_micro_benchmark_bf16_vs_block_fp8() -> None:
    """us per call on each Qwen3-8B projection shape: bf16 F.linear vs the block-FP8 linear as the layers
    run it (group quantize + GEMM: Triton, or cuBLASLt's blockwise GEMM from SCALED_MM_MIN_M rows on sm90),
    the Triton path at every M and its GEMM alone, all replayed from CUDA graphs."""
    import triton

    from kernels.fp8_block_gemm import (
        SCALED_MM_MIN_M,
        blockwise_scaled_mm_available,
        gemm_config,
        per_token_group_quant_fp8,
        scaled_mm_takes,
        w8a8_block_fp8_matmul,
    )
    from runtime.layers.fp8_block_linear import fp8_block_linear

    if not _sm89():
        pytest.skip("the block kernels need sm89+ (e4m3)")
    sweep = os.environ.get("SHOAL_FP8_BLOCK_SWEEP") == "1"
    cublas = blockwise_scaled_mm_available(torch.device("cuda"))
    rows, tuning = [], []
    for shape, (n, k) in SHAPES.items():
        w, w8, scale = _layer(n, k)
        cub = cublas and scaled_mm_takes(w8, BLOCK)
        for m in M_LIST:
            x = torch.randn(m, k, device="cuda", dtype=DT)
            xq, xs = per_token_group_quant_fp8(x, BLOCK[1])
            row = {"shape": shape, "n": n, "k": k, "m": m,
                   "bf16_us": _time_us(lambda: torch.nn.functional.linear(x, w)),  # noqa: B023
                   "fp8_block_us": _time_us(
                       lambda: fp8_block_linear(x, w8, scale, BLOCK, None, True, cub)),  # noqa: B023
                   "fp8_block_triton_us": _time_us(
                       lambda: fp8_block_linear(x, w8, scale, BLOCK, None, True, False)),  # noqa: B023
                   "fp8_triton_gemm_only_us": _time_us(
                       lambda: w8a8_block_fp8_matmul(xq, xs, w8, scale, BLOCK, DT)),  # noqa: B023
                   "path": "torch._scaled_mm blockwise" if cub and m >= SCALED_MM_MIN_M else "triton",
                   "config": gemm_config(m, n, k, BLOCK[1])}
            row["speedup"] = row["bf16_us"] / row["fp8_block_us"]
            rows.append(row)
            if sweep and shape in ("qkv", "down"):
                for entry in SWEEP[m]:
                    cfg = _cfg(*entry, m)
                    us = _time_us(lambda: w8a8_block_fp8_matmul(xq, xs, w8, scale, BLOCK, DT, cfg))  # noqa: B023
                    tuning.append({"shape": shape, "m": m, "config": cfg, "gemm_us": us})
            print(f"{shape:8s} M={m:5d}: bf16 {row['bf16_us']:8.1f} us, block fp8 {row['fp8_block_us']:8.1f} us "
                  f"({row['path']}; Triton {row['fp8_block_triton_us']:8.1f}, its GEMM "
                  f"{row['fp8_triton_gemm_only_us']:8.1f})")
    for m in M_LIST:
        per_m = [r for r in rows if r["m"] == m]
        print(f"layer M={m:5d}: bf16 {sum(r['bf16_us'] for r in per_m):8.1f} us, block fp8 "
              f"{sum(r['fp8_block_us'] for r in per_m):8.1f} us")
    out = os.environ.get("SHOAL_FP8_BLOCK_BENCH_OUT")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({
            "benchmark": "fp8_block_gemm", "device": torch.cuda.get_device_name(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": triton.__version__},
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "method": "triton.testing.do_bench_cudagraph(rep=50); weights N(0, 0.02) block-quantized [128, 128]; "
                      "x bf16 N(0, 1); fp8_block_us = fp8_block_linear as the layers run it (per-token-group "
                      "quantize + GEMM, bf16 out; path says which GEMM); fp8_block_triton_us = the Triton "
                      "kernels at every M",
            "shapes": "Qwen3-8B projections (N, K)", "rows": rows, "tuning": tuning}, indent=2))
    assert all(r["fp8_block_us"] < 2.0 * r["bf16_us"] for r in rows), rows  # a broken tile would be far slower
