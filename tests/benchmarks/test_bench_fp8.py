"""The FP8 benchmarks in smoke form: the accuracy bench end to end on a tiny checkpoint (teacher-forced
agreement with the bf16 reference, the fp32 noise floor beside it, JSON with the device), and the GPU
bench's summary of its per-mode subprocess results."""

from __future__ import annotations

import json

from benchmarks import bench_fp8, bench_fp8_accuracy


def test_accuracy_bench_smoke(tiny_llama, tmp_path) -> None:
    out = tmp_path / "acc.json"
    bench_fp8_accuracy.main(["--model-path", str(tiny_llama), "--num-prompts", "3", "--gen-len", "4",
                             "--output-file", str(out)])
    doc = json.loads(out.read_text())
    assert doc["device"].startswith("cpu") and doc["benchmark"] == "fp8_accuracy"
    res = doc["results"][tiny_llama.name]
    assert res["ref_dtype"] == "bfloat16" and res["prompts"] == 3 and res["gen_len"] == 4
    modes = res["modes"]
    assert set(modes) == {"fp8_kv", "fp8_kv_static_scale_1", "fp8_weights", "fp8_kv_and_weights", "float32_no_fp8",
                          "fp8_weights@compressed-tensors-per-tensor"}
    assert modes["fp8_kv"]["kv_scales"]["source"] == "calibrate" and len(modes["fp8_kv"]["kv_scales"]["k"]) == 2
    assert modes["fp8_kv_static_scale_1"]["kv_scales"] == {"source": "static", "k": [1.0, 1.0], "v": [1.0, 1.0]}
    assert "kv_scales" not in modes["fp8_weights"]
    for m in modes.values():
        assert 0.0 <= m["top1_agreement"] <= 1.0 and m["mean_abs_logprob_diff"] >= 0.0
        assert m["disagreements"] == round((1 - m["top1_agreement"]) * 12)
    assert modes["fp8_kv"]["target"] == 0.97 and modes["fp8_weights"]["target"] == 0.95
    assert modes["fp8_kv"]["mean_abs_logprob_diff"] > 0  # FP8 really changed something


def test_accuracy_bench_runs_the_modes_asked_for(tiny_llama) -> None:
    res = bench_fp8_accuracy.main(["--model-path", str(tiny_llama), "--num-prompts", "2", "--gen-len", "2",
                                   "--modes", "fp8_kv,float32_no_fp8"])
    assert set(res[tiny_llama.name]["modes"]) == {"fp8_kv", "float32_no_fp8"}


def test_kv_error_sources_smoke(tiny_llama, tmp_path) -> None:
    from benchmarks import bench_fp8_kv_error_sources

    out = tmp_path / "es.json"
    res = bench_fp8_kv_error_sources.main(["--model-path", str(tiny_llama), "--num-prompts", "2", "--gen-len", "3",
                                           "--output-file", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "fp8_kv_error_sources"
    assert len(res["layers"]) == 2 and res["layers"][0]["k_amax"] > 0
    assert len(res["variants"]) == 8 and all(0 <= v["top1_agreement"] <= 1 for v in res["variants"].values())
    # the rounding really happened (the tiny model's reference is bf16, the variant's K/V went through e4m3)
    assert res["variants"]["fp8_k_and_v_calibrated"]["mean_abs_logprob_diff"] > 0


def test_gpu_bench_summary() -> None:
    results = {"bf16": {"output_throughput": 8000.0, "max_total_tokens": 400_000},
               "fp8_kv": {"output_throughput": 11000.0, "max_total_tokens": 800_000},
               "broken": {"error": "exit 1", "log_tail": ""}}
    s = bench_fp8._summary("throughput", results)
    assert s["kv_capacity_ratio"] == 2.0 and s["fp8_kv_output_tok_s"] == 11000.0 and s["broken_error"] == "exit 1"
    assert bench_fp8._summary("batch1", {"bf16": {"decode_step_ms": 5.5}}) == {"bf16_decode_step_ms": 5.5}
