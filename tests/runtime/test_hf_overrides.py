"""--hf-overrides (vLLM's flag): a JSON object merged over the checkpoint's config.json before it is read.
Bad JSON or a non-object is a ServerArgsError naming the flag; a tiny gte-Qwen2-style checkpoint whose
config.json says is_causal false is refused before its weights load, and served with '{"is_causal": true}'
(equal to HF AutoModel's pooled last hidden state); an override of max_position_embeddings changes the
context length."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from runtime import Engine
from runtime.cli import build_parser, server_args
from runtime.config import ServerArgs
from runtime.errors import InvalidRequestError, ServerArgsError
from runtime.model_config import ModelConfig

ENGINE_KWARGS = {"device": "cpu", "dtype": "float32", "max_total_tokens": 1024, "log_level": "warning",
                 "is_embedding": True}


@pytest.mark.parametrize("value, words", [
    ("{is_causal: true}", "is not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ("true", "must be a JSON object"),
    ({"bad": {1, 2}}, "must be JSON-serializable"),
    (5, "must be a str"),
])
def test_bad_values_name_the_flag(value, words):
    with pytest.raises(ServerArgsError, match=words) as e:
        ServerArgs(hf_overrides=value)
    assert e.value.flag == "--hf-overrides"


def test_cli_string_and_python_dict():
    ns = build_parser().parse_args(["serve", "--hf-overrides", '{"is_causal": true, "rope_theta": 5e5}'])
    args = server_args(ns)
    assert args.hf_config_overrides == {"is_causal": True, "rope_theta": 500000.0}
    as_dict = ServerArgs(hf_overrides={"is_causal": True, "rope_theta": 5e5})  # Engine(hf_overrides={...})
    assert isinstance(as_dict.hf_overrides, str) and as_dict.hf_config_overrides == args.hf_config_overrides
    assert ServerArgs().hf_config_overrides == {}


def test_model_config_reads_the_merged_dict(tiny_model_dirs):
    path = tiny_model_dirs["qwen2"]
    base = ModelConfig.from_pretrained(path)
    cfg = ModelConfig.from_pretrained(path, overrides={"max_position_embeddings": 128,
                                                       "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert (base.max_position_embeddings, cfg.max_position_embeddings) == (512, 128)
    # the tiny config carries transformers 5's rope_parameters; an overridden rope_scaling still wins there
    assert (cfg.rope.scaling_type, cfg.rope.factor, cfg.rope.theta) == ("linear", 2.0, base.rope.theta)
    assert cfg.hidden_size == base.hidden_size  # the keys not overridden are config.json's


@pytest.fixture(scope="module")
def gte_like(tiny_model_dirs, tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny Qwen2, a copy whose config.json says is_causal false and declares the bare Qwen2Model, as
    gte-Qwen2-1.5B-instruct's does)."""
    src = tiny_model_dirs["qwen2"]
    dst = tmp_path_factory.mktemp("gte") / "gte"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "is_causal": False, "architectures": ["Qwen2Model"]}))
    return src, dst


def test_is_causal_false_refused_before_loading(gte_like, tmp_path):
    _, gte = gte_like
    shutil.copytree(gte, tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors"))  # nothing to load
    with pytest.raises(ServerArgsError, match=r"is_causal false .*--hf-overrides '\{\"is_causal\": true\}'"):
        Engine(str(tmp_path / "m"), **ENGINE_KWARGS)


def test_served_with_the_override_and_a_shorter_context(gte_like):
    from transformers import AutoModel

    src, gte = gte_like
    engine = Engine(str(gte), hf_overrides={"is_causal": True, "max_position_embeddings": 256}, **ENGINE_KWARGS)
    try:
        assert engine.context_len == 256  # config.json says 512
        ids = [engine.tokenizer.encode(t) for t in ("The capital of France is Paris.", "Hello")]
        got = [o["embedding"] for o in engine.encode(input_ids=ids)]
        hf = AutoModel.from_pretrained(str(src), dtype=torch.float32).eval()
        with torch.inference_mode():
            for g, x in zip(got, ids):
                want = torch.nn.functional.normalize(hf(torch.tensor([x])).last_hidden_state[0, -1], dim=-1)
                torch.testing.assert_close(torch.tensor(g), want, atol=2e-5, rtol=1e-4)
        with pytest.raises(InvalidRequestError, match="maximum context length is 256 tokens, but input 0 has 257"):
            engine.encode(input_ids=[5] * 257)
    finally:
        engine.shutdown()
