"""bench_fp8_gemv in smoke form on CPU (Triton interpreter, tiny shapes): every method runs, agrees with
the w8a16 reference (the w8a8 path within activation-quantization error), and the JSON carries the device,
per-shape GB/s and the 32-layer summary."""

from __future__ import annotations

import json

from benchmarks import bench_fp8_gemv


def test_bench_fp8_gemv_smoke(tmp_path) -> None:
    out = tmp_path / "gemv.json"
    bench_fp8_gemv.main(["--smoke", "--m", "1", "3", "--shapes", "o", "down", "lm_head", "--replays", "1",
                         "--output-file", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "fp8_gemv" and doc["device"].startswith("cpu")
    assert set(doc["results"]["shapes"]) == {"o", "down", "lm_head"}
    for shape in doc["results"]["shapes"].values():
        for m in ("1", "3"):
            row = shape["by_m"][m]
            assert row["fp8_gemv"]["max_rel_err_vs_w8a16_ref"] < 1e-5
            assert row["bf16_matmul"]["max_rel_err_vs_w8a16_ref"] < 0.1  # unquantized weights
            assert 0 < row["w8a8_scaled_mm"]["max_rel_err_vs_w8a16_ref"] < 0.1
            # the one-launch quantize gives the torch ops' bits, so the same product
            assert row["w8a8_fused_quant"]["max_rel_err_vs_w8a16_ref"] == row["w8a8_scaled_mm"]["max_rel_err_vs_w8a16_ref"]
            # the dense GEMV on the same unquantized weights: the matmul's result up to summation order
            assert abs(row["dense_gemv"]["max_rel_err_vs_w8a16_ref"] - row["bf16_matmul"]["max_rel_err_vs_w8a16_ref"]) < 1e-4
            assert all(row[k]["GB_s"] > 0 for k in bench_fp8_gemv.METHODS)
    summary = doc["results"]["summary"]
    assert summary["m1_fp8_gemv_32layers_ms"] > 0 and summary["m3_w8a8_scaled_mm_32layers_ms"] > 0
    shapes = doc["results"]["shapes"]  # 32 layers of o and down, the LM head once
    want = sum(n * shapes[s]["by_m"]["1"]["dense_gemv"]["us"] for s, n in (("o", 32), ("down", 32), ("lm_head", 1)))
    assert abs(summary["m1_dense_gemv_32layers_ms"] - want / 1e3) < 1e-9


def test_sweep_configs_are_valid() -> None:
    for m in (1, 2, 4, 8, 16):
        cfgs = bench_fp8_gemv.sweep_configs(m)
        assert len(cfgs) >= 8 and len(set(cfgs)) == len(cfgs)
        bm = 1 << (m - 1).bit_length()
        assert all(c.use_dot or bm * c.block_n * c.block_k <= 16384 for c in cfgs)
    wide = {(c.block_n, c.block_k) for c in bench_fp8_gemv.sweep_configs(32) if c.use_dot}
    assert {(128, 64), (128, 128)} <= wide  # 17-64 rows also try tiles that feed a whole x tile
