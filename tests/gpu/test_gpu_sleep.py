"""Sleep mode on the GPU with CUDA graphs on (runtime/model_executor/memory_sleep.py): while asleep,
torch.cuda.memory_allocated is lower by at least the weights' and the KV pool's bytes (the graphs' pool goes
too); after wake_up the graphs are captured again and the greedy outputs are HF's, as before (level 1); level 2,
wake_up and an update from disk serve the new checkpoint under the new graphs; an FP8 KV cache with a rotation
and FP8 quantize-at-load weights come back bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_models import save_bf16_llama
from tiny_models import hf_greedy_ids, make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]
# GEMM-friendly shapes for the FP8 kernels (the tiny fixture's are not)
MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
N = 12
SP = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}


def _hf_greedy(path: Path) -> list[int]:
    return hf_greedy_ids(path, PROMPT, N)


def _bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_sleep_gives_the_memory_back_and_wake_up_serves_the_same_model(tiny_llama: Path, tmp_path: Path) -> None:
    from runtime import Engine
    from runtime.admin_messages import EngineAsleepError

    b = make_tiny_model("llama", tmp_path / "b", seed=1)
    want = {"a": _hf_greedy(tiny_llama), "b": _hf_greedy(b)}
    engine = Engine(str(tiny_llama), device="cuda", dtype="float32", max_total_tokens=65536, log_level="warning",
                    cuda_graph_max_bs=8)
    try:
        runner = engine.worker.runner
        assert runner.cuda_graph_runner is not None
        assert engine.generate(input_ids=PROMPT, sampling_params=SP)["output_ids"] == want["a"]
        pool = runner.token_to_kv_pool
        weights = _bytes({p.untyped_storage().data_ptr(): p for p in runner.model.parameters()}.values())
        kv = _bytes([*pool.k_buffers, *pool.v_buffers])
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        engine.sleep(level=1)
        assert runner.cuda_graph_runner is None
        assert before - (asleep := torch.cuda.memory_allocated()) >= weights + kv
        with pytest.raises(EngineAsleepError):
            engine.generate(input_ids=PROMPT, sampling_params=SP)
        engine.wake_up()
        assert runner.cuda_graph_runner is not None and runner.cuda_graph_runner.graphs  # captured again
        assert engine.generate(input_ids=PROMPT, sampling_params=SP)["output_ids"] == want["a"]
        assert engine.generate(input_ids=PROMPT, sampling_params=SP)["output_ids"] == want["a"]  # prefix-cached

        engine.sleep(level=2)
        # nothing the wake_up took outlives this sleep: before the cuBLAS workspaces were cleared at sleep (and
        # the capture warmed up on one stream, not one a size) this read ~168 MB above the first sleep's
        assert torch.cuda.memory_allocated() <= asleep + (1 << 20)
        engine.wake_up(tags=["weights"])
        ok, message, _ = engine.update_weights_from_disk(str(b))
        assert ok, message
        engine.wake_up(tags=["kv_cache"])
        assert runner.cuda_graph_runner is not None
        assert engine.generate(input_ids=PROMPT, sampling_params=SP)["output_ids"] == want["b"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("args", [
    {"quantization": "fp8"},
    {"kv_cache_dtype": "fp8_e4m3", "kv_cache_rotation": "hadamard", "kv_cache_scale": 0.05},
], ids=["fp8-weights", "fp8-kv-rotation"])
def test_fp8_layouts_come_back_bit_for_bit_under_graphs(tmp_path: Path, args: dict) -> None:
    from runtime import Engine
    from runtime.model_executor.memory_sleep import _storages

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm89+")
    engine = Engine(str(save_bf16_llama(tmp_path / "m", MODEL)), device="cuda", dtype="bfloat16", max_total_tokens=8192, log_level="warning",
                    cuda_graph_max_bs=8, **args)
    try:
        model = engine.worker.runner.model
        ref = engine.generate(input_ids=PROMPT, sampling_params=SP)["output_ids"]
        state = [t.detach().reshape(-1).view(torch.uint8).clone() for t, _ in _storages(model)]
        engine.sleep()
        engine.wake_up()
        after = [t.detach().reshape(-1).view(torch.uint8) for t, _ in _storages(model)]
        assert len(after) == len(state) and all(torch.equal(a, s) for a, s in zip(after, state))
        assert engine.generate(input_ids=PROMPT, sampling_params=SP)["output_ids"] == ref
    finally:
        engine.shutdown()
