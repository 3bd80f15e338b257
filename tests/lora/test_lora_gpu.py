"""LoRA on the GPU (fp32 tiny Llama, so HF's merged-weight greedy outputs are the reference): a batch mixing
base requests and two adapters, with its decode steps replayed from CUDA graphs (the slot tensor a static
input, the adapter mask computed inside the graph) and without graphs, gives every request HF's result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_files import hf_greedy, hf_merged, write_adapter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

N = 12
PROMPTS = [[5, 9, 13, 40, 22, 7, 31, 18, 44, 3, 27, 11], [60, 2, 17, 8], [33, 33, 12, 90, 4, 4, 71]]
NAMES = [None, "attn_mlp", "kv_up", "kv_up", None, "attn_mlp", "attn_mlp"]


@pytest.mark.parametrize("graphs", [True, False])
def test_mixed_batch_matches_hf_merged(tiny_llama: Path, tmp_path: Path, graphs: bool):
    from runtime import Engine

    adapters = {
        "attn_mlp": write_adapter(tmp_path / "a", tiny_llama, 1, ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")),
        "kv_up": write_adapter(tmp_path / "b", tiny_llama, 2, ("k_proj", "up_proj", "q_proj"), r=8, alpha=4, rslora=True),
    }
    prompts = [PROMPTS[i % 3] for i in range(len(NAMES))]
    expected = {}
    for name in (None, *adapters):
        model = hf_merged(tiny_llama, None if name is None else adapters[name])
        for i, p in enumerate(PROMPTS):
            expected[name, i] = hf_greedy(model, p, N)
    engine = Engine(str(tiny_llama), device="cuda", dtype="float32", max_total_tokens=4096, log_level="warning",
                    enable_lora=True, lora_modules=" ".join(f"{n}={p}" for n, p in adapters.items()),
                    cuda_graph_max_bs=8, disable_cuda_graph=not graphs)
    try:
        assert (engine.worker.runner.cuda_graph_runner is not None) == graphs
        sp = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}
        outs = engine.generate(input_ids=prompts, sampling_params=sp, lora_name=NAMES)
        for i, (name, o) in enumerate(zip(NAMES, outs)):
            assert o["output_ids"] == expected[name, i % 3], (i, name)
        for i in (1, 2):  # alone: the same
            o = engine.generate(input_ids=prompts[i], sampling_params=sp, lora_name=NAMES[i])
            assert o["output_ids"] == expected[NAMES[i], i % 3]
    finally:
        engine.shutdown()


def test_runtime_load_under_cuda_graphs(tiny_llama: Path, tmp_path: Path):
    """Adapters loaded after the graphs were captured (into the --max-lora-rank-sized buffers the graphs read)
    serve HF's merged outputs from graph replays; unloading one leaves the other and the base exact."""
    from runtime import Engine

    one = write_adapter(tmp_path / "one", tiny_llama, 12, ("q_proj", "v_proj", "o_proj", "down_proj"), r=8)
    two = write_adapter(tmp_path / "two", tiny_llama, 13, ("q_proj", "k_proj", "v_proj", "up_proj"), r=2, alpha=16)
    expected = {name: hf_greedy(hf_merged(tiny_llama, path), PROMPTS[0], N)
                for name, path in ((None, None), ("one", one), ("two", two))}
    engine = Engine(str(tiny_llama), device="cuda", dtype="float32", max_total_tokens=4096, log_level="warning",
                    enable_lora=True, max_loras=2, cuda_graph_max_bs=8)
    try:
        assert engine.worker.runner.cuda_graph_runner is not None
        engine.load_lora_adapter("one", str(one))
        engine.load_lora_adapter("two", str(two))
        sp = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}
        names = [None, "one", "two", "one", None, "two"]
        outs = engine.generate(input_ids=[PROMPTS[0]] * len(names), sampling_params=sp, lora_name=names)
        assert [o["output_ids"] for o in outs] == [expected[n] for n in names]
        engine.unload_lora_adapter("one")
        outs = engine.generate(input_ids=[PROMPTS[0]] * 2, sampling_params=sp, lora_name=["two", None])
        assert [o["output_ids"] for o in outs] == [expected["two"], expected[None]]
    finally:
        engine.shutdown()


def test_fp8_kv_cache_with_adapters(tiny_llama: Path, tmp_path: Path):
    """--enable-lora --kv-cache-dtype fp8_e4m3 on the GPU (bf16, the adapters' v/o terms folded with the
    KV rotation): an adapter tracks HF on its merged weights as closely as the FP8 KV engine without LoRA
    tracks HF on the base (tests/lora/test_lora_fp8_kv.py's measure), and decode graphs give eager's tokens."""
    from test_lora_fp8_kv import ALL, SEQS, _distance, _hf_logprobs, _score

    from runtime import Engine

    adapter = write_adapter(tmp_path / "dyn", tiny_llama, 22, ALL, r=4, alpha=4)
    kw = {"device": "cuda", "dtype": "bfloat16", "log_level": "warning", "chunked_prefill_size": 8,
          "kv_cache_dtype": "fp8_e4m3", "max_total_tokens": 4096, "cuda_graph_max_bs": 8}
    base_engine = Engine(str(tiny_llama), **kw)
    try:
        base_err, base_agree = _distance(_score(base_engine, [None])[0], _hf_logprobs(tiny_llama, None))
    finally:
        base_engine.shutdown()
    tokens = {}
    for graphs in (True, False):
        engine = Engine(str(tiny_llama), **kw, enable_lora=True, max_loras=2, max_lora_rank=8,
                        disable_cuda_graph=not graphs)
        try:
            engine.load_lora_adapter("dyn", str(adapter))
            if graphs:
                err, agree = _distance(_score(engine, ["dyn"])[0], _hf_logprobs(tiny_llama, adapter))
                print(f"\n[lora fp8 kv] base {base_err:.4f} / {base_agree:.3f}, adapter {err:.4f} / {agree:.3f}")
                assert err <= 2 * base_err + 0.01 and agree >= base_agree - 0.05
            sp = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}
            tokens[graphs] = [o["output_ids"] for o in engine.generate(
                input_ids=SEQS, sampling_params=sp, lora_name=["dyn", None, "dyn"])]
        finally:
            engine.shutdown()
    assert tokens[True] == tokens[False]
