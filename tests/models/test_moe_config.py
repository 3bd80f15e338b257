"""MoE config.json fields (read, checked with errors naming the field), the shipped Mixtral-8x7B and
Qwen3-30B-A3B configs, dummy weights for a MoE model, a checkpoint missing an expert, and FP8 quantized at load."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from moe_tiny import make_tiny_moe

from runtime.errors import ModelConfigError, WeightLoadError
from runtime.model_config import ModelConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "model_executor"))
from runner_driver import RunnerDriver  # noqa: E402

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    return make_tiny_moe("mixtral", tmp_path_factory.mktemp("mixtral"))


def _qwen3_moe(**over) -> dict:
    raw = json.loads((CONFIGS / "Qwen3-30B-A3B.json").read_text())
    raw.update(over)
    return raw


def test_shipped_configs() -> None:
    raw = json.loads((CONFIGS / "Mixtral-8x7B-Instruct-v0.1.json").read_text())
    mixtral = ModelConfig.from_dict(raw)
    assert mixtral.architecture == "MixtralForCausalLM" and mixtral.moe is not None
    m = mixtral.moe
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (8, 2, 14336)
    assert m.norm_topk_prob and m.router_weights_fp32 and not m.shared_expert_intermediate_size
    assert all(mixtral.is_sparse_layer(i) for i in range(32)) and not mixtral.has_sliding_window
    qwen = ModelConfig.from_dict(_qwen3_moe())
    m = qwen.moe
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob) == (128, 8, 768, True)
    assert qwen.qk_norm and not qwen.attention_bias and qwen.head_dim == 128 and qwen.intermediate_size == 6144
    assert ModelConfig.from_dict(_qwen3_moe(mlp_only_layers=[0, 5], decoder_sparse_step=2)).moe.mlp_only_layers == (0, 5)
    layers = ModelConfig.from_dict(_qwen3_moe(mlp_only_layers=[5], decoder_sparse_step=2))
    assert [layers.is_sparse_layer(i) for i in range(8)] == [False, True, False, True, False, False, False, True]
    dense = ModelConfig.from_dict({**raw, "architectures": ["MistralForCausalLM"]})
    assert dense.moe is None and not dense.is_sparse_layer(0)


@pytest.mark.parametrize(("over", "field"), [
    ({"num_experts": 0}, "num_experts"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ({"moe_intermediate_size": -1}, "moe_intermediate_size"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"mlp_only_layers": [48]}, "mlp_only_layers"),
    ({"mlp_only_layers": "0"}, "mlp_only_layers"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_bad_moe_fields_are_named(over: dict, field: str) -> None:
    with pytest.raises(ModelConfigError, match=f"'{field}'"):
        ModelConfig.from_dict(_qwen3_moe(**over))


def test_qwen2_moe_needs_its_shared_expert_size() -> None:
    raw = _qwen3_moe(architectures=["Qwen2MoeForCausalLM"])
    with pytest.raises(ModelConfigError, match="'shared_expert_intermediate_size'"):
        ModelConfig.from_dict(raw)
    cfg = ModelConfig.from_dict({**raw, "shared_expert_intermediate_size": 5632})
    assert cfg.attention_bias and not cfg.qk_norm and cfg.moe.shared_expert_intermediate_size == 5632


def test_dummy_weights_run_a_moe_model(mixtral_dir: Path) -> None:
    d = RunnerDriver(mixtral_dir, load_format="dummy", max_total_tokens=256)
    from runtime.model_executor.forward_mode import ForwardMode

    _, out = d.step(ForwardMode.EXTEND, [d.new_row()], [[1, 2, 3, 4]])
    assert torch.isfinite(out.next_token_logits).all()
    w13 = d.runner.model.model.layers[0].mlp.experts.w13_weight
    assert w13.abs().amax() > 0 and not torch.equal(w13[0], w13[1])  # every expert got its own tensors


def test_missing_expert_tensor_is_named(mixtral_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    for f in mixtral_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(mixtral_dir / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.3\.w3\.weight"):
        RunnerDriver(tmp_path, max_total_tokens=256)


def test_fp8_quantizes_a_moe_model_at_load(mixtral_dir: Path) -> None:
    """--quantization fp8 on a 16-bit MoE checkpoint: attention and every expert stack in fp8 (per channel),
    near the 16-bit model; the flags the experts have no path for are refused by name."""
    from runtime.errors import ServerArgsError
    from runtime.model_executor.forward_mode import ForwardMode

    logits = {}
    for quant in (None, "fp8"):
        d = RunnerDriver(mixtral_dir, quantization=quant, max_total_tokens=256)
        _, out = d.step(ForwardMode.EXTEND, [d.new_row() for _ in range(3)],
                        [[5, 17, 33, 101, 250, 7, 9], [42, 300, 12], [8, 8, 90, 91, 92]])
        logits[quant] = out.next_token_logits.float()
    experts = d.runner.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.w13_weight_scale.shape == (4, 2 * 96)
    ref, got = logits[None], logits["fp8"]
    # e4m3 weights and activations on a hidden-64 model: the experts alone move the logits by ~5-10% (their
    # plain amax scales; the dense layers' are calibrated), the whole model by ~8-13%, measured
    assert float(((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max()) < 0.2
    assert int((got.argmax(-1) == ref.argmax(-1)).sum()) >= 2
    with pytest.raises(ServerArgsError, match="--fp8-weight-only"):
        RunnerDriver(mixtral_dir, quantization="fp8", fp8_weight_only=True, max_total_tokens=256)


def test_bf16_cpu_fast_paths_serve_a_moe_model(mixtral_dir: Path) -> None:
    """bf16 on CPU packs the dense linears and fuses norms/activations (cpu_config.prepare_model); the
    experts stay plain GEMMs. Same answer as fp32 up to bf16 rounding."""
    from runtime.model_executor.forward_mode import ForwardMode

    logits = {}
    for dtype in ("float32", "bfloat16"):
        d = RunnerDriver(mixtral_dir, dtype=dtype, max_total_tokens=256)
        _, out = d.step(ForwardMode.EXTEND, [d.new_row()], [[5, 17, 33, 101, 250, 7, 9]])
        logits[dtype] = out.next_token_logits[0].float()
    ref, got = logits["float32"], logits["bfloat16"]
    assert (got - ref).abs().max() < 0.05 * ref.abs().max() and got.argmax() == ref.argmax()
