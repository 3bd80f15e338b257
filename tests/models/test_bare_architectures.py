"""Bare architectures (no LM head), as embedding checkpoints declare them: a tiny checkpoint saved from
transformers' bare Qwen3Model / MistralModel (config.json's `architectures` as transformers writes it,
tensor names without 'model.') embeds on an --is-embedding engine equal to HF AutoModel's pooled last
hidden state, with no LM head built (none stands in for the missing one); a generation engine refuses it
by name before loading anything."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runtime import Engine
from runtime.errors import ModelConfigError
from runtime.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

PROMPTS = ["The quick brown fox jumps over the lazy dog. The capital of France is Paris.", "Hello"]
ENGINE_KWARGS = {"device": "cpu", "dtype": "float32", "max_total_tokens": 1024, "log_level": "warning"}


def bare_copy(src: Path, dst: Path) -> Path:
    """The tokenizer of `src` and its weights saved from the bare *Model, as transformers writes them."""
    from transformers import AutoModel

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    AutoModel.from_pretrained(str(src), dtype=torch.float32).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def bare_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bare")
    return {arch: bare_copy(tiny_model_dirs[arch], root / arch) for arch in ("qwen3", "mistral")}


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.shutdown()


@pytest.mark.parametrize("arch, declared", [("qwen3", "Qwen3Model"), ("mistral", "MistralModel")])
def test_bare_checkpoint_embeds_as_hf_automodel(bare_dirs, engines, arch, declared):
    from transformers import AutoModel

    path = bare_dirs[arch]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [declared]  # as transformers wrote it, untouched
    # Qwen3's tiny model ties its head; Mistral's does not, and no vocab x hidden head is built for it either.
    assert cfg["tie_word_embeddings"] is (arch == "qwen3")
    engine = Engine(str(path), is_embedding=True, chunked_prefill_size=8, **ENGINE_KWARGS)
    engines.append(engine)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    got = [o["embedding"] for o in engine.encode(input_ids=ids)]
    model = engine.worker.runner.model
    assert model.lm_head is None
    assert [n for n, t in model.named_parameters() if t.shape[0] == cfg["vocab_size"]] == ["model.embed_tokens.weight"]
    hf = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [torch.nn.functional.normalize(hf(torch.tensor([x])).last_hidden_state[0, -1], dim=-1) for x in ids]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g), w, atol=2e-5, rtol=1e-4)


def test_generation_engine_refuses_bare_checkpoint(bare_dirs):
    with pytest.raises(ModelConfigError, match=r"Qwen3Model is a bare model \(no LM head\): serve it with "
                                               r"--is-embedding"):
        Engine(str(bare_dirs["qwen3"]), **ENGINE_KWARGS)


@pytest.mark.parametrize("bare, causal", [("LlamaModel", "LlamaForCausalLM"), ("MistralModel", "MistralForCausalLM"),
                                          ("Qwen2Model", "Qwen2ForCausalLM"), ("Qwen3Model", "Qwen3ForCausalLM")])
def test_bare_architectures_map_to_the_causal_class(bare, causal):
    assert SUPPORTED_ARCHITECTURES[bare] == SUPPORTED_ARCHITECTURES[causal]
    raw = {"architectures": [bare], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.is_bare and cfg.model_type == SUPPORTED_ARCHITECTURES[causal][0]
    cfg.check_task(True, "m")  # fine on an embedding server
    with pytest.raises(ModelConfigError, match="serve it with --is-embedding"):
        cfg.check_task(False, "m")
    assert not ModelConfig.from_dict({**raw, "architectures": [causal]}).is_bare
