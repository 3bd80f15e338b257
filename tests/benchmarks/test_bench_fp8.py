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
    assert set(modes) == {"fp8_kv", "fp8_kv_rotation_none", "fp8_kv_rotation_hadamard", "fp8_kv_static_scale_1", "fp8_weights", "fp8_kv_and_weights", "float32_no_fp8",
                          "fp8_weights@compressed-tensors-per-tensor", "fp8_weights_w8a16",
                          "fp8_weights_w8a8_mse_scales", "fp8_weights_w8a16_mse_scales",
                          "fp8_weights_w8a8_amax_scales", "fp8_weights_w8a16_amax_scales", "fp8_weights_act2", "fp8_weights_lm_head",
                          "fp8_weights_w8a16_lm_head"}
    assert modes["fp8_weights_w8a16"]["server_args"]["fp8_weight_only"] is True
    assert modes["fp8_weights_act2"]["server_args"]["fp8_act_terms"] == 2
    assert modes["fp8_weights_w8a16_lm_head"]["server_args"]["fp8_lm_head"] is True
    assert all(m["target"] == 0.95 for k, m in modes.items() if k.startswith("fp8_weights"))
    assert modes["fp8_kv"]["kv_scales"]["source"] == "calibrate" and len(modes["fp8_kv"]["kv_scales"]["k"]) == 2
    assert modes["fp8_kv_static_scale_1"]["kv_scales"] == {"source": "static", "k": [1.0, 1.0], "v": [1.0, 1.0],
                                                           "rotation": "none"}
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


def test_weight_error_sources_smoke(tiny_llama, tmp_path) -> None:
    from benchmarks import bench_fp8_weight_error_sources

    out = tmp_path / "ws.json"
    res = bench_fp8_weight_error_sources.main(["--model-path", str(tiny_llama), "--num-prompts", "2", "--gen-len",
                                               "3", "--variants", "w8a8_all (,w8a16_all (,hmse,down_hadamard",
                                               "--output-file", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "fp8_weight_error_sources"
    got = res["variants"]
    assert "w8a8_all (served above M 16, the CPU default)" in got and "w8a8_all_down_hadamard" in got
    assert all(0 <= v["top1_agreement"] <= 1 for v in got.values())
    # the rounding really happened, and w8a16 (bf16 activations) moves the logprobs less than w8a8
    w8a8 = got["w8a8_all (served above M 16, the CPU default)"]["mean_abs_logprob_diff"]
    assert 0 < got["w8a16_all (the GEMV served at M <= 16)"]["mean_abs_logprob_diff"] < w8a8
    assert set(res["rotation_gain_per_layer"]) == {"qkv", "o", "gate_up", "down"}


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


def test_emulation_rotation_is_exact_and_schemes_round() -> None:
    """The emulated down-projection rotation is orthogonal and folds exactly (W x = (W H^T)(H x)) before
    rounding; token/group activation schemes round each value to e4m3 under its token's (group's) scale."""
    import torch

    from benchmarks.emulated_linear import EmulatedLinear, act_round, block_hadamard

    h = block_hadamard(1536)
    torch.testing.assert_close(h @ h.t(), torch.eye(1536), atol=1e-5, rtol=0)
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 1536, generator=gen) * 0.05, torch.randn(7, 1536, generator=gen)
    rotated = EmulatedLinear(w, "bf16", "bf16", rot=h)(x)
    torch.testing.assert_close(rotated, x @ w.t(), atol=1e-4, rtol=1e-4)
    for mode, g in (("token", 1536), ("group64", 64)):
        xg = x.reshape(7, -1, g)
        xq = act_round(x, mode).reshape(7, -1, g)
        s = xg.abs().amax(-1, keepdim=True) / 448.0
        # e4m3 round-to-nearest: half an ulp, 2^-4 of |x| in the normal range, s * 2^-10 in the subnormals
        bound = torch.maximum(xg.abs() * 2.0 ** -4, s * 2.0 ** -10) * (1 + 1e-5)
        assert bool(((xq - xg).abs() <= bound).all()) and not torch.equal(xq, xg)


def test_emulation_smoothing_is_exact_before_rounding() -> None:
    """SmoothQuant's x / s and W s cancel exactly without rounding; s follows amax|x|^a / amax|W|^(1-a)."""
    import torch

    from benchmarks.emulated_linear import EmulatedLinear, smooth_factors

    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(24, 64, generator=gen) * 0.05, torch.randn(5, 64, generator=gen)
    x[:, 3] *= 40  # an outlier channel
    s = smooth_factors(x.abs().amax(0), w, 0.5)
    assert int(s.argmax()) == 3
    torch.testing.assert_close(s, (x.abs().amax(0).sqrt() / w.abs().amax(0).sqrt()), rtol=1e-6, atol=0)
    torch.testing.assert_close(EmulatedLinear(w, "bf16", "bf16", smooth=s)(x), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert not torch.equal(EmulatedLinear(w, "token", "bf16", smooth=s)(x), x @ w.t())  # rounded when asked


def test_gpu_bench_passes_switches_without_a_value() -> None:
    """bench_fp8's modes become bench_offline flags: a boolean ServerArgs switch (--fp8-lm-head) goes alone."""
    import argparse
    from pathlib import Path

    from benchmarks.bench_fp8 import _offline_argv
    from benchmarks.bench_offline import parse_args as offline_args

    ns = argparse.Namespace(model_config="Llama-3.1-8B-Instruct", input_len=None, output_len=None,
                            attention_backend="auto")
    argv = _offline_argv(ns, "batch1", "fp8_weights_lm_head", Path("/tmp/x.json"))
    assert argv[argv.index("--quantization") + 1] == "fp8" and argv[-1] == "--fp8-lm-head"
    parsed = offline_args(argv[3:])
    assert parsed.fp8_lm_head is True and parsed.quantization == "fp8"
