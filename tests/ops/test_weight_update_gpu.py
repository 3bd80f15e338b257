"""Live weight updates on the GPU with CUDA graphs captured: the graphs hold the parameters' addresses, so an
update from disk or from tensors has to land in place; the replays then give HF's greedy outputs on the new
weights (fp32 tiny Llama, two checkpoints with different random weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import hf_greedy_ids, make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]
N = 12
SP = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}


def _hf_greedy(path: Path) -> list[int]:
    return hf_greedy_ids(path, PROMPT, N)


def test_updates_land_under_cuda_graphs(tiny_llama: Path, tmp_path: Path) -> None:
    from runtime import Engine

    b = make_tiny_model("llama", tmp_path / "b", seed=1)
    want = {"a": _hf_greedy(tiny_llama), "b": _hf_greedy(b)}
    assert want["a"] != want["b"]
    engine = Engine(str(tiny_llama), device="cuda", dtype="float32", max_total_tokens=4096, log_level="warning",
                    cuda_graph_max_bs=8)
    try:
        assert engine.worker.runner.cuda_graph_runner is not None
        params = dict(engine.worker.runner.model.named_parameters())
        ptrs = {k: p.data_ptr() for k, p in params.items()}
        assert engine.generate(input_ids=PROMPT, sampling_params=SP)["output_ids"] == want["a"]
        ok, msg, _ = engine.update_weights_from_disk(str(b))
        assert ok, msg
        assert engine.generate(input_ids=PROMPT, sampling_params=SP)["output_ids"] == want["b"]
        [f] = list(tiny_llama.glob("*.safetensors"))
        ok, msg = engine.update_weights_from_tensor(list(load_file(str(f)).items()))
        assert ok, msg
        assert engine.generate(input_ids=PROMPT, sampling_params=SP)["output_ids"] == want["a"]
        assert {k: p.data_ptr() for k, p in engine.worker.runner.model.named_parameters()} == ptrs
    finally:
        engine.shutdown()
