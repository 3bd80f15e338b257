"""The engine-side benchmarks' argument handling and workloads (the runs themselves need the Engine), the
HF static-batching baseline on a tiny model, the result writer, configs and plot tables."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bench_offline, bench_prefix_cache, bench_static_vs_continuous, plot  # noqa: E402
from benchmarks.common import (  # noqa: E402
    CONFIGS_DIR,
    load_model_config,
    make_model_folder,
    write_result,
)

PUBLISHED = {  # name: (layers, hidden, heads, kv heads, vocab, billions of parameters)
    "Llama-3.1-8B-Instruct": (32, 4096, 32, 8, 128256, 8.03),
    "Llama-3.1-70B-Instruct": (80, 8192, 64, 8, 128256, 70.55),
    "Llama-3.2-1B-Instruct": (16, 2048, 32, 8, 128256, 1.24),
    "Qwen2.5-7B-Instruct": (28, 3584, 28, 4, 152064, 7.62),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_configs_match_published_shapes(name):
    c = load_model_config(name)
    layers, hidden, heads, kv, vocab, billions = PUBLISHED[name]
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c["vocab_size"]) == (layers, hidden, heads, kv, vocab)
    assert c["torch_dtype"] == "bfloat16"
    hd = c.get("head_dim", hidden // heads)
    params = layers * (hidden * hd * (heads + 2 * kv) + hd * heads * hidden + 3 * hidden * c["intermediate_size"])
    params += vocab * hidden * (1 if c["tie_word_embeddings"] else 2)
    assert params / 1e9 == pytest.approx(billions, abs=0.01)
    if name.startswith("Llama"):
        assert c["rope_scaling"]["rope_type"] == "llama3" and c["eos_token_id"] == [128001, 128008, 128009]


def test_model_folder_from_name(tmp_path):
    folder = make_model_folder("Qwen2.5-7B-Instruct", tmp_path / "m")
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    with pytest.raises(FileNotFoundError, match="Llama-3.1-8B-Instruct"):
        make_model_folder("no-such-model", tmp_path / "x")


def test_offline_args_pass_engine_flags_through():
    args = bench_offline.parse_args(["--model-config", "Llama-3.2-1B-Instruct", "--attention-backend", "triton",
                                     "--disable-cuda-graph", "--max-running-requests", "64", "--enable-mixed-chunk",
                                     "--chunked-prefill-size", "2048", "--tp-size", "2"])
    assert args.load_format == "dummy" and args.dtype == "bfloat16"
    assert bench_offline.engine_extras(args) == {
        "attention_backend": "triton", "disable_cuda_graph": True, "max_running_requests": 64,
        "enable_mixed_chunk": True, "chunked_prefill_size": 2048, "tp_size": 2}
    assert (args.input_len, args.output_len) == (1024, 1024)
    b1 = bench_offline.parse_args(["--model-path", "/m", "--batch1-decode"])
    assert (b1.input_len, b1.output_len, b1.load_format) == (128, 512, "auto")
    assert bench_offline.engine_extras(b1) == {}
    with pytest.raises(SystemExit):
        bench_offline.parse_args(["--num-prompts", "3"])  # no model


def test_offline_workload_is_seeded_and_in_range():
    args = bench_offline.parse_args(["--model-config", "Llama-3.1-8B-Instruct", "--num-prompts", "64",
                                     "--input-len", "100", "--output-len", "40", "--range-ratio", "0.5"])
    cfg = load_model_config(args.model_config)
    prompts, params = bench_offline.build_workload(args, cfg)
    again, _ = bench_offline.build_workload(args, cfg)
    assert prompts == again and len(prompts) == 64
    assert all(50 <= len(p) <= 100 for p in prompts)
    assert all(20 <= sp["max_new_tokens"] <= 40 and sp["ignore_eos"] and sp["temperature"] == 0.0 for sp in params)
    assert not {t for p in prompts for t in p} & {128000, 128001, 128008, 128009}


def test_stats_delta_subtracts_per_mode():
    before = {"EXTEND": {"batches": 2, "tokens": 100, "time_s": 1.0},
              "IDLE": {"batches": 1, "tokens": 0, "time_s": 0.1}}
    after = {"EXTEND": {"batches": 5, "tokens": 400, "time_s": 2.5}, "DECODE": {"batches": 7, "tokens": 70, "time_s": 0.7},
             "IDLE": {"batches": 1, "tokens": 0, "time_s": 0.1}}
    assert bench_offline.stats_delta(before, after) == {  # modes that ran nothing in between are left out
        "EXTEND": {"batches": 3, "tokens": 300, "time_s": 1.5}, "DECODE": {"batches": 7, "tokens": 70, "time_s": 0.7}}


def test_prefix_cache_prompts_share_the_system_prompt():
    args = bench_prefix_cache.parse_args(["--model-config", "Llama-3.2-1B-Instruct", "--num-questions", "20"])
    system, prompts = bench_prefix_cache.build_workload(args, load_model_config(args.model_config))
    assert len(system) == 1024 and len(prompts) == 20
    assert all(p[:1024] == system and 16 <= len(p) - 1024 <= 64 for p in prompts)
    with pytest.raises(SystemExit):
        bench_prefix_cache.parse_args(["--model-config", "x", "--disable-radix-cache"])


def test_static_batching_accounting():
    args = bench_static_vs_continuous.parse_args(["--model-config", "Tiny-Llama-smoke", "--num-requests", "10",
                                                  "--output-range", "1", "9", "--static-batch-size", "4"])
    w = bench_static_vs_continuous.build_workload(args, load_model_config("Tiny-Llama-smoke"))
    batches = bench_static_vs_continuous.static_batches(w, 4)
    assert [len(b[0]) for b in batches] == [4, 4, 2]
    expected = sum(len(outs) * max(outs) for _, outs in batches)
    assert bench_static_vs_continuous.padded_tokens(w, 4) == expected >= w.useful_tokens
    ids, mask = bench_static_vs_continuous.left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids == [[5, 6, 7], [0, 0, 8]] and mask == [[1, 1, 1], [0, 0, 1]]


def test_static_vs_continuous_cpu_smoke_hf_static_and_shoal(tmp_path):
    out = tmp_path / "svc.json"
    res = bench_static_vs_continuous.main([
        "--model-config", "Tiny-Llama-smoke", "--device", "cpu", "--dtype", "float32", "--num-requests", "6",
        "--input-range", "4", "12", "--output-range", "2", "6", "--static-batch-size", "4",
        "--skip", "hf-continuous", "--work-dir", str(tmp_path), "--output-file", str(out)])
    static = res["cases"]["hf_static"]
    assert static["useful_tokens"] == res["useful_tokens"] and static["useful_tok_per_s"] > 0
    shoal = res["cases"]["shoal"]  # run in a spawned interpreter: its numbers come back whole
    assert shoal["useful_tokens"] == shoal["expected_tokens"] == res["useful_tokens"]
    assert shoal["forward_modes"]["DECODE"]["batches"] > 0 and res["ratios"]["shoal/hf_static"] > 0
    assert static["generated_tokens_incl_padding"] == res["padded_tokens_static"]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "static_vs_continuous" and doc["device"].startswith("cpu")
    assert doc["versions"]["transformers"] and doc["config"]["resolved_device"] == "cpu"


def test_static_vs_continuous_shoal_first_reloads_the_same_weights_for_hf(tmp_path):
    """--order shoal hf-static: Shoal runs first (the HF model freed), then HF static on the weights
    reloaded from the saved folder; both produce every useful token, and each case records the machine
    during its run (host CPU at least on a CPU machine) and Shoal its JIT compiles."""
    res = bench_static_vs_continuous.main([
        "--model-config", "Tiny-Llama-smoke", "--device", "cpu", "--dtype", "float32", "--num-requests", "6",
        "--input-range", "4", "12", "--output-range", "2", "6", "--static-batch-size", "4",
        "--order", "shoal", "hf-static", "hf-continuous", "--skip", "hf-continuous", "--work-dir", str(tmp_path)])
    assert list(res["cases"]) == ["shoal", "hf_static"]
    static, shoal = res["cases"]["hf_static"], res["cases"]["shoal"]
    assert static["useful_tokens"] == shoal["useful_tokens"] == res["useful_tokens"]
    assert static["generated_tokens_incl_padding"] == res["padded_tokens_static"]
    assert "span_s" in static["system_during_run"] and "span_s" in shoal["system_during_run"]
    assert shoal["triton_compiles_in_run"]["count"] >= 0
    with pytest.raises(SystemExit):
        bench_static_vs_continuous.parse_args(["--model-config", "Tiny-Llama-smoke", "--order", "shoal", "shoal"])


def test_result_writer_and_plot_tables(tmp_path, capsys, monkeypatch):
    results = {"request_throughput": 2.0, "output_throughput": 100.0, "failed": 1,
               "ttft_ms": {"p50": 10.0, "p99": math.nan}, "itl_ms": {"p50": 2.0, "p99": 5.0}}
    monkeypatch.setenv("SHOAL_PDL", "0")  # a switch the run was made under is recorded with it
    path = write_result(tmp_path / "r" / "serve_a.json", "serving", results, {"request_rate": math.inf}, argv=["x"])
    doc = json.loads(path.read_text())  # strict JSON: NaN and inf were rewritten
    assert doc["results"]["ttft_ms"]["p99"] is None and doc["config"]["request_rate"] == "inf"
    assert {"device", "versions", "date", "command"} <= set(doc)
    assert doc["env"]["SHOAL_PDL"] == "0" and all(k.startswith("SHOAL_") for k in doc["env"])
    (tmp_path / "r" / "junk.json").write_text("{not json")
    assert plot.main([str(tmp_path / "r"), "--out-dir", str(tmp_path / "plots")]) == 0
    printed = capsys.readouterr().out
    assert "| serve_a (" in printed and "| 2.00 | 100.00 | 10.00 | - | 2.00 | 5.00 | 1.00 |" in printed


def test_every_shipped_config_is_loadable_by_transformers():
    from transformers import AutoConfig

    for f in sorted(CONFIGS_DIR.glob("*.json")):
        cfg = AutoConfig.from_pretrained(str(f))
        assert cfg.architectures and cfg.vocab_size > 0
