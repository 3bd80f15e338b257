"""sweep_decode_gemm --smoke on CPU (Triton interpreter): every candidate checked against the fp32 product,
the best one and the per-M sums written as JSON."""

from __future__ import annotations

import json

from benchmarks import sweep_decode_gemm


def test_smoke_sweep_writes_best_config_and_sums(tmp_path) -> None:
    out = tmp_path / "gemm.json"
    assert sweep_decode_gemm.main(["--smoke", "--m", "16", "--shapes", "qkv", "o", "--output-file", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "sweep_decode_gemm"
    row = doc["results"]["shapes"]["qkv"]["by_m"]["16"]
    assert row["best"] is not None and row["best"]["max_rel_err"] < 2e-2
    assert len(row["sweep"]) == len(sweep_decode_gemm.candidates(16, 96, 64, 132, smoke=True))
    sums = doc["results"]["summary"]["m16"]
    assert sums["best_of_both"] <= min(sums["cublas"], sums["triton_best"])


def test_candidates_keep_tiles_near_m_and_split_only_narrow_grids() -> None:
    import math

    for cfg in sweep_decode_gemm.candidates(32, 28672, 4096, 132):
        tiles = math.ceil(32 / cfg.block_m) * math.ceil(28672 / cfg.block_n)
        assert cfg.block_m <= 64 and (cfg.split_k == 1 or tiles < 132)  # split-K only where tiles leave SMs idle
    cands = sweep_decode_gemm.candidates(256, 4096, 14336, 132)
    assert any(c.split_k > 1 for c in cands) and all(c.block_m >= 64 for c in cands)
    assert all(c.smem_bytes() <= sweep_decode_gemm.SMEM_LIMIT for c in cands)
