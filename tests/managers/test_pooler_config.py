"""--pooler-config (vLLM's; --override-pooler-config, its older name): a JSON object of PoolerConfig keys put
over the pooling the model folder says. The CLI takes both names (and Engine a dict); bad JSON, unknown keys,
bad values, token-wise pooling (ALL / STEP) and the keys Shoal has no counterpart for are ServerArgsErrors
naming the flag and the key; the override beats sentence-transformers' modules.json; an embedding engine
over a last-token folder pools MEAN / CLS as asked (against HF's hidden states, fp32), with the prefix cache
off for them; dimensions becomes the default Matryoshka size; a classifier's use_activation false gives raw
logits, and its pooling stays LAST."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_engine_embeddings import PROMPTS, assert_close, embedding_copy, hf_vectors, vec

from runtime import Engine
from runtime.cli import build_parser, server_args
from runtime.config import ServerArgs
from runtime.errors import ServerArgsError
from runtime.text.pooling_config import PoolingConfig

CHUNK = 8  # the long prompts run in several chunks: mean and CLS carry state across them


@pytest.mark.parametrize("flag", ["--pooler-config", "--override-pooler-config"])
def test_cli_takes_both_names(flag):
    ns = build_parser().parse_args(["serve", "m", "--is-embedding", flag, '{"pooling_type": "MEAN", "normalize": false}'])
    args = server_args(ns)
    assert args.pooler_overrides == {"pooling_type": "mean", "normalize": False}
    # vLLM's --runner pooling is an embedding server too; null is vLLM's "unset"
    ns = build_parser().parse_args(["serve", "m", "--runner", "pooling", flag, '{"pooling_type": "cls", "dimensions": null}'])
    assert server_args(ns).pooler_overrides == {"pooling_type": "cls"}


def test_engine_dict_and_older_key_names():
    args = ServerArgs(is_embedding=True, pooler_config={"seq_pooling_type": "Last", "softmax": False, "activation": False})
    assert args.pooler_overrides == {"pooling_type": "last", "use_activation": False}
    assert ServerArgs(is_embedding=True).pooler_overrides == {}


@pytest.mark.parametrize("value, key, words", [
    ("{pooling_type: MEAN}", None, "is not valid JSON"),
    ('["MEAN"]', None, "must be a JSON object"),
    ('{"pooling": "MEAN"}', "pooling", "unknown; vLLM's PoolerConfig keys are pooling_type"),
    ('{"pooling_type": "ALL"}', "pooling_type", "token-wise pooling"),
    ('{"pooling_type": "step"}', "pooling_type", "token-wise pooling"),
    ('{"tok_pooling_type": "ALL"}', "tok_pooling_type", "token-wise pooling"),
    ('{"pooling_type": "MAX"}', "pooling_type", "must be LAST, MEAN or CLS, got 'MAX'"),
    ('{"pooling_type": 1}', "pooling_type", "must be LAST, MEAN or CLS"),
    ('{"pooling_type": "MEAN", "seq_pooling_type": "CLS"}', "seq_pooling_type", "not both"),
    ('{"normalize": "false"}', "normalize", "must be true or false"),
    ('{"dimensions": 0}', "dimensions", "must be a positive integer"),
    ('{"dimensions": true}', "dimensions", "must be a positive integer"),
    ('{"use_activation": true, "activation": false}', "use_activation", "disagree"),
    ('{"enable_chunked_processing": true}', "enable_chunked_processing", "not embedded in pieces"),
    ('{"logit_bias": 0.5}', "logit_bias", "calibration"),
    ('{"step_tag_id": 3}', "step_tag_id", "STEP pooling"),
    ('{"task": "embed"}', "task", "the task follows the model"),
])
def test_bad_configs_name_the_flag_and_key(value, key, words):
    with pytest.raises(ServerArgsError, match=words) as e:
        ServerArgs(is_embedding=True, pooler_config=value)
    assert e.value.flag == "--pooler-config"
    if key is not None:
        assert f"key {key!r}" in str(e.value)


def test_refused_on_a_generation_server():
    with pytest.raises(ServerArgsError, match="--is-embedding") as e:
        ServerArgs(pooler_config='{"pooling_type": "MEAN"}')
    assert e.value.flag == "--pooler-config"
    ServerArgs(pooler_config="{}")  # nothing asked: nothing to refuse


def test_override_beats_modules_json(tiny_model_dirs, tmp_path):
    path = embedding_copy(tiny_model_dirs["llama"], tmp_path / "mean", "mean_tokens", False)
    assert (PoolingConfig.read(path).pooling_type, PoolingConfig.read(path).normalize) == ("mean", False)
    over = PoolingConfig.read(path, None, {"pooling_type": "cls", "normalize": True})
    assert (over.pooling_type, over.normalize) == ("cls", True)
    assert over.source == "--pooler-config over 1_Pooling/config.json"
    # through ServerArgs as a server reads it; vLLM's newer use_activation is an embedder's normalize
    args = ServerArgs(model_path=str(path), is_embedding=True, pooler_config='{"use_activation": true}')
    assert PoolingConfig.for_server(args).normalize and PoolingConfig.for_server(args).pooling_type == "mean"
    assert PoolingConfig.for_model(ServerArgs(), path) is None  # a generation server pools nothing
    with pytest.raises(ServerArgsError, match="disagree"):
        PoolingConfig.read(path, None, {"normalize": True, "use_activation": False})
    with pytest.raises(ServerArgsError, match=r"key 'dimensions': .*matryoshka") as e:
        PoolingConfig.read(path, None, {"dimensions": 16})
    assert e.value.flag == "--pooler-config"


def test_default_dimensions(tiny_model_dirs, tmp_path):
    path = embedding_copy(tiny_model_dirs["qwen3"], tmp_path / "mrl", "lasttoken", True, matryoshka_dimensions=[16, 32, 64])
    with pytest.raises(ServerArgsError, match=r"key 'dimensions': .*only supports dimensions \[16, 32, 64\]"):
        PoolingConfig.read(path, None, {"dimensions": 20})
    pooling = PoolingConfig.read(path, None, {"dimensions": 16})
    full = [float(i + 1) for i in range(64)]
    short = pooling.shorten(full, None)  # a request without dimensions gets the server's
    assert len(short) == 16
    torch.testing.assert_close(torch.tensor(short), torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0))
    assert len(pooling.shorten(full, 32)) == 32  # a request's own wins


def test_classifier_honours_use_activation_and_refuses_embedder_keys(tiny_model_dirs, tmp_path):
    path = tmp_path / "clf"
    path.mkdir()
    cfg = json.loads((tiny_model_dirs["qwen3"] / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForSequenceClassification"],
                                                  "id2label": {"0": "neg", "1": "pos"}}))
    assert PoolingConfig.read(path).probabilities([0.0, 0.0]) == [0.5, 0.5]
    raw = PoolingConfig.read(path, None, {"use_activation": False, "pooling_type": "last", "normalize": False})
    assert raw.use_activation is False and raw.labels == ("neg", "pos")  # the default; a request may ask again
    old_name = PoolingConfig.read(path, None, {"normalize": False})  # vLLM's older spelling of use_activation
    assert old_name.use_activation is False and old_name.normalize is False
    for bad, key in (({"normalize": True, "use_activation": False}, "normalize"), ({"dimensions": 1}, "dimensions")):
        with pytest.raises(ServerArgsError, match=f"key '{key}'"):
            PoolingConfig.read(path, None, bad)


@pytest.mark.parametrize("mode, normalize", [("mean", False), ("cls", True)])
def test_engine_pools_as_overridden(make_engine, tiny_model_dirs, mode, normalize):
    """A folder without sentence-transformers files (last token, normalized) served MEAN / CLS as asked."""
    path: Path = tiny_model_dirs["qwen3"]
    engine: Engine = make_engine(path, is_embedding=True, chunked_prefill_size=CHUNK, max_prefill_tokens=CHUNK,
                                 pooler_config={"pooling_type": mode.upper(), "normalize": normalize})
    assert (engine.pooling.pooling_type, engine.pooling.normalize) == (mode, normalize)
    assert engine.worker.runner.pooler.name == mode
    assert not engine.scheduler.kv.enabled  # mean and CLS read every position: no cached prefix
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert_close(vec(engine.encode(input_ids=ids)), hf_vectors(path, ids, mode, normalize))
