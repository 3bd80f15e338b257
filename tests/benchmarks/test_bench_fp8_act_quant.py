"""bench_fp8_act_quant in smoke form on CPU (Triton interpreter, tiny shapes): every method runs, the
kernel gives the torch ops' bits (quantize and the linear after it, gated down projection included), and
the JSON carries the device and the 32-layer summary."""

from __future__ import annotations

import json

from benchmarks import bench_fp8_act_quant


def test_bench_fp8_act_quant_smoke(tmp_path) -> None:
    out = tmp_path / "act_quant.json"
    bench_fp8_act_quant.main(["--smoke", "--m", "17", "40", "--shapes", "o", "down", "--replays", "1",
                              "--output-file", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "fp8_act_quant" and doc["device"].startswith("cpu")
    assert set(doc["results"]["shapes"]) == {"o", "down"} and doc["results"]["shapes"]["down"]["gated"]
    for shape in doc["results"]["shapes"].values():
        for m in ("17", "40"):
            row = shape["by_m"][m]
            assert row["bit_equal"] and row["linear_bit_equal"]
            assert all(row[k] > 0 for k in row if k.endswith("_us"))
    assert doc["results"]["summary"]["m40_kernel_quant_scaled_mm_32layers_ms"] > 0
