"""A quantized checkpoint's model is built on the meta device and allocated after prepare(): the 16-bit
projections its layers replace are never allocated (a 70B AWQ / FP8 checkpoint would otherwise need the whole
bf16 model's memory before quantized loading began; review of b0acb47 / 7cb10ac). The loaded model still
answers as before (the checkpoint tests in tests/quant and tests/quant_fp8 compare it with HF), with shared
parameters still shared and the rotary table computed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from int4_checkpoints import write_int4_checkpoint

from runtime.layers.int4_linear import int4_linear_modules
from runtime.model_executor.fp8_weights import Fp8Weights
from runtime.model_executor.int4_weights import Int4Weights

sys.path.insert(0, str(Path(__file__).parents[1] / "model_executor"))
from runner_driver import RunnerDriver  # noqa: E402


@pytest.mark.parametrize("quant", ["awq", "fp8-block", "fp8-at-load"])
def test_projections_are_meta_until_prepared(tiny_llama, tiny_model_dirs, tmp_path, monkeypatch, quant) -> None:
    seen: dict[str, set[str]] = {}
    cls = Int4Weights if quant == "awq" else Fp8Weights
    real = cls.prepare

    def spy(self, model):  # the projections' weights as prepare() finds them
        seen["devices"] = {m.weight.device.type for _, m in int4_linear_modules(model)}
        real(self, model)

    monkeypatch.setattr(cls, "prepare", spy)
    if quant == "awq":
        path, _ = write_int4_checkpoint(tiny_llama, tmp_path / "awq", "awq", 32)
        d = RunnerDriver(path)
    elif quant == "fp8-block":
        sys.path.insert(0, str(Path(__file__).parents[1] / "quant_fp8"))
        from block_fp8_checkpoints import write_block_fp8_checkpoint

        path, _ = write_block_fp8_checkpoint(tiny_model_dirs["qwen3"], tmp_path / "blk", (32, 32))  # tied
        d = RunnerDriver(path)
    else:  # quantize-at-load reads the 16-bit weights: built on the device as before
        d = RunnerDriver(tiny_model_dirs["qwen3"], quantization="fp8")
    assert seen["devices"] == ({"cpu"} if quant == "fp8-at-load" else {"meta"})
    model = d.runner.model
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    rotary = model.model.layers[0].self_attn.rotary_emb
    assert rotary.cos_sin_cache.shape[0] == model.cfg.max_position_embeddings
    assert float(rotary.cos_sin_cache[0, 0]) == 1.0  # cos(0): computed, not left uninitialized
    if model.cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.isfinite(model.model.norm.weight).all()


def test_dummy_weights_with_an_act_order_config(tiny_llama, tmp_path) -> None:
    """--load-format dummy with a GPTQ desc_act config.json (speed runs): the random weights are quantized in
    column order, so there is no g_idx to group by (it raised KeyError 'g_idx'; review of b0acb47)."""
    from checkpoint_dirs import with_quant_config
    from int4_checkpoints import quant_config

    ckpt = with_quant_config(tiny_llama, tmp_path / "d", {**quant_config("gptq", 32), "desc_act": True})
    d = RunnerDriver(ckpt, load_format="dummy")
    assert all(t.device.type == "cpu" for t in d.runner.model.parameters())
