"""YaRN rope scaling (Qwen2.5 / Qwen3 cards' rope_scaling for 128k contexts): the inverse frequencies and the
attention factor equal HF's _compute_yarn_parameters, the context it allows is original x factor (as vLLM
derives max_model_len), and a tiny Qwen2 with yarn generates HF's greedy tokens past the original length."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import save_random_model

from runtime.errors import ModelConfigError
from runtime.layers.rotary import RotaryEmbedding, _inv_freq
from runtime.model_config import ModelConfig, _rope

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3's card
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek's style
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.5,
     "truncate": False},
])
def test_inv_freq_and_attention_factor_equal_hf(params: dict) -> None:
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = Qwen2Config(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
                         rope_theta=1000000.0, rope_scaling=dict(params))
    inv_hf, factor_hf = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    rope = _rope({"rope_theta": 1000000.0, "rope_scaling": dict(params), "max_position_embeddings": 131072})
    torch.testing.assert_close(_inv_freq(128, rope), inv_hf.float(), rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(factor_hf)
    cache = RotaryEmbedding(128, 8, rope).cos_sin_cache
    assert float(cache[0, 0]) == pytest.approx(factor_hf)  # cos(0) scaled: every kernel reads it so


def test_yarn_config_context_and_errors(tmp_path: Path) -> None:
    base = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 32768, "rope_theta": 1e6}
    cfg = ModelConfig.from_dict({**base, "rope_scaling": {**YARN, "original_max_position_embeddings": 32768}})
    assert cfg.max_position_embeddings == 131072 and cfg.rope.scaling_type == "yarn"
    with pytest.raises(ModelConfigError, match="original_max_position_embeddings"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelConfigError, match="dynamic"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


@pytest.fixture(scope="module")
def yarn_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config

    def config(vocab: int, eos: int) -> Qwen2Config:
        return Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           rms_norm_eps=1e-5, eos_token_id=eos, bos_token_id=eos - 1, pad_token_id=0,
                           tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=dict(YARN))
    return save_random_model(tmp_path_factory.mktemp("yarn_qwen2"), config, seed=3)


def test_yarn_model_matches_hf_past_the_original_length(yarn_qwen2: Path) -> None:
    from transformers import AutoModelForCausalLM

    from runtime import Engine

    hf = AutoModelForCausalLM.from_pretrained(str(yarn_qwen2), dtype=torch.float32).eval()
    prompts = [[(5 * i + 11) % 300 + 3 for i in range(60)], [(3 * i + 7) % 250 + 3 for i in range(20)]]
    n = 24
    with torch.inference_mode():
        want = []
        for p in prompts:
            ids = list(p)
            for _ in range(n):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            want.append(ids[len(p):])
    with Engine(str(yarn_qwen2), device="cpu", max_total_tokens=1024, log_level="warning") as engine:
        assert engine.worker.runner.context_len == 128  # max(128, 32 x 4)
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": n,
                                                                   "ignore_eos": True})
    assert [o["output_ids"] for o in outs] == want
