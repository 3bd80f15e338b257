"""ModelConfig: reads the HF config.json of each supported architecture; rejects bad ones with a message
that names what is wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import ServerArgs
from runtime.errors import ModelConfigError
from runtime.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from runtime.model_executor.model_runner import ModelRunner


def _raw(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def _folder_with(tmp_path: Path, raw: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_reads_each_architecture(tiny_model_dirs) -> None:
    llama = ModelConfig.from_pretrained(tiny_model_dirs["llama"])
    assert (llama.architecture, llama.model_type) == ("LlamaForCausalLM", "llama")
    assert (llama.vocab_size, llama.hidden_size, llama.intermediate_size) == (400, 64, 128)
    assert (llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (2, 4, 2, 16)
    assert llama.rope.scaling_type == "llama3" and llama.rope.factor == 8.0
    assert llama.rope.original_max_position_embeddings == 64 and llama.rope.theta == 10000.0
    assert not llama.attention_bias and not llama.qk_norm and not llama.tie_word_embeddings
    assert llama.dtype == torch.float32 and llama.max_position_embeddings == 512 and llama.rms_norm_eps == 1e-5
    assert llama.eos_token_ids == (_raw(tiny_model_dirs["llama"])["eos_token_id"],)

    qwen2 = ModelConfig.from_pretrained(tiny_model_dirs["qwen2"])
    assert qwen2.model_type == "qwen2" and qwen2.attention_bias and not qwen2.qk_norm
    assert qwen2.rope.theta == 1e6 and qwen2.rope.scaling_type == "default"

    qwen3 = ModelConfig.from_pretrained(tiny_model_dirs["qwen3"])
    assert qwen3.model_type == "qwen3" and qwen3.qk_norm and not qwen3.attention_bias
    assert qwen3.head_dim == 32 and qwen3.tie_word_embeddings  # head_dim given explicitly, not hidden/heads

    assert ModelConfig.from_pretrained(tiny_model_dirs["mistral"]).model_type == "mistral"


def test_published_style_rope_fields_and_dtype_override(tiny_llama) -> None:
    raw = _raw(tiny_llama)
    del raw["rope_parameters"]
    raw.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0}, torch_dtype="bfloat16")
    del raw["dtype"]
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope.theta == 500000.0 and cfg.rope.scaling_type == "linear" and cfg.rope.factor == 2.0
    assert cfg.dtype == torch.bfloat16
    assert ModelConfig.from_dict(raw, dtype="float16").dtype == torch.float16
    raw.pop("num_key_value_heads")
    assert ModelConfig.from_dict(raw).num_key_value_heads == raw["num_attention_heads"]  # MHA default


def test_unsupported_architecture_lists_supported_ones(tiny_llama, tmp_path) -> None:
    raw = {**_raw(tiny_llama), "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel") as e:
        ModelRunner(ServerArgs(device="cpu", max_total_tokens=64), str(_folder_with(tmp_path, raw)))
    assert all(name in str(e.value) for name in SUPPORTED_ARCHITECTURES)
    with pytest.raises(ModelConfigError, match="missing"):
        ModelConfig.from_dict({k: v for k, v in raw.items() if k != "architectures"})


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
                                   "num_hidden_layers", "max_position_embeddings"])
def test_missing_required_field_is_named(tiny_llama, field: str) -> None:
    raw = _raw(tiny_llama)
    del raw[field]
    with pytest.raises(ModelConfigError, match=f"missing required field '{field}'"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "64"])
def test_non_positive_integer_field_is_named(tiny_llama, value: Any) -> None:
    with pytest.raises(ModelConfigError, match="'num_hidden_layers' must be a positive integer"):
        ModelConfig.from_dict({**_raw(tiny_llama), "num_hidden_layers": value})


def test_kv_heads_must_divide_heads(tiny_llama) -> None:
    with pytest.raises(ModelConfigError, match=r"num_key_value_heads' \(3\) must divide num_attention_heads \(4\)"):
        ModelConfig.from_dict({**_raw(tiny_llama), "num_key_value_heads": 3})


def test_hidden_not_divisible_by_heads_without_head_dim(tiny_llama) -> None:
    raw = {**_raw(tiny_llama), "hidden_size": 66}
    del raw["head_dim"]
    with pytest.raises(ModelConfigError, match="hidden_size 66 is not divisible by num_attention_heads 4"):
        ModelConfig.from_dict(raw)


def test_bad_rope_type_lists_supported(tiny_llama) -> None:
    raw = _raw(tiny_llama)
    raw["rope_parameters"] = {**raw["rope_parameters"], "rope_type": "longrope"}
    with pytest.raises(ModelConfigError, match="'longrope'.*default, llama3, linear, yarn"):
        ModelConfig.from_dict(raw)
    raw["rope_parameters"] = {"rope_theta": -1.0}
    with pytest.raises(ModelConfigError, match="rope_theta"):
        ModelConfig.from_dict(raw)


def test_other_bad_fields(tiny_llama) -> None:
    with pytest.raises(ModelConfigError, match="hidden_act"):
        ModelConfig.from_dict({**_raw(tiny_llama), "hidden_act": "gelu"})
    with pytest.raises(ModelConfigError, match="float64"):
        ModelConfig.from_dict({**_raw(tiny_llama), "dtype": "float64"})
    with pytest.raises(ModelConfigError, match="mlp_bias"):
        ModelConfig.from_dict({**_raw(tiny_llama), "mlp_bias": True})
    with pytest.raises(ModelConfigError, match="attention_bias.*o_proj"):  # HF gives its o_proj a bias too
        ModelConfig.from_dict({**_raw(tiny_llama), "attention_bias": True})


def test_missing_or_broken_config_json(tmp_path) -> None:
    with pytest.raises(ModelConfigError, match=f"no config.json in model folder {tmp_path}"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelRunner(ServerArgs(device="cpu", max_total_tokens=64), str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


_BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


@pytest.mark.parametrize(("arch", "extra", "windows"), [
    ("MistralForCausalLM", {"sliding_window": 8}, (8, 8, 8, 8)),
    ("MistralForCausalLM", {"sliding_window": None}, ()),
    # HF's Mistral ignores layer_types; its Llama ignores sliding_window altogether.
    ("MistralForCausalLM", {"sliding_window": 8, "layer_types": ["full_attention"] * 4}, (8, 8, 8, 8)),
    ("LlamaForCausalLM", {"sliding_window": 8}, ()),
    # Qwen2: nothing without use_sliding_window, whatever else the config says.
    ("Qwen2ForCausalLM", {"sliding_window": 8, "use_sliding_window": False,
                          "layer_types": ["sliding_attention"] * 4}, ()),
    ("Qwen2ForCausalLM", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2}, (0, 0, 8, 8)),
    ("Qwen2ForCausalLM", {"sliding_window": 8, "use_sliding_window": True}, ()),  # max_window_layers defaults to 28
    ("Qwen3ForCausalLM", {"sliding_window": 8, "use_sliding_window": True,
                          "layer_types": ["sliding_attention", "full_attention"] * 2}, (8, 0, 8, 0)),
])
def test_sliding_windows_per_layer_as_transformers(arch, extra, windows) -> None:
    cfg = ModelConfig.from_dict({**_BASE, "architectures": [arch], **extra})
    assert cfg.sliding_windows == windows
    assert cfg.has_sliding_window == bool(windows)
    assert [cfg.layer_sliding_window(i) for i in range(4)] == list(windows or (0,) * 4)


def test_generation_config_eos_ids_end_requests(tiny_llama, tmp_path) -> None:
    """generation_config.json's eos_token_id joins config.json's (vLLM and SGLang stop on both; Qwen2.5-Instruct's
    <|endoftext|> is only there): a greedy request ends with finish_reason stop at the first one it makes."""
    import shutil

    from tiny_models import hf_greedy_ids

    from runtime import Engine

    folder = tmp_path / "llama"
    shutil.copytree(tiny_llama, folder)
    prompt = [5, 17, 42, 99]
    want = hf_greedy_ids(folder, prompt, 8)
    base = ModelConfig.from_pretrained(folder).eos_token_ids
    stop = next(t for t in want[2:] if t not in base)  # not among the first two: the request ends at it
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [*base, stop, True, "x"]}))
    assert ModelConfig.from_pretrained(folder).eos_token_ids == (*base, stop)
    (folder / "generation_config.json").write_text("{not json")
    assert ModelConfig.from_pretrained(folder).eos_token_ids == base  # unreadable: adds none
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
    with Engine(str(folder), device="cpu", dtype="float32", max_total_tokens=512, log_level="warning") as engine:
        out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 8})
    assert out["finish_reason"] == "stop" and out["output_ids"] == want[:want.index(stop) + 1]
