"""Sequence-classification (reward / classifier) models on an --is-embedding engine: tiny Llama (1 label, a
reward model) and Qwen3 (3 named labels) checkpoints saved by transformers' AutoModelForSequenceClassification
score equal to HF's logits at the last token through Engine.classify (vLLM's activation on top, or raw) and
Engine.encode, a long prompt chunked by prefill scores the same, and a generation engine refuses the
architecture by name before loading anything."""

from __future__ import annotations

import json
import math

import pytest
import torch
from classify_models import ENGINE_KWARGS, LONG, PROMPTS, hf_logits

from runtime import Engine
from runtime.errors import InvalidRequestError, ModelConfigError
from runtime.model_config import ModelConfig, classifier_labels
from runtime.models.registry import get_model_class


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_scores_equal_hf_logits(classifier_dirs, engines, arch):
    engine, path = engines[arch], classifier_dirs[arch]
    ids = [engine.tokenizer.encode(p) for p in [*PROMPTS, LONG]]
    assert len(ids[-1]) > 40  # several 16-token prefill chunks
    want = hf_logits(path, ids)
    raw = engine.classify(input_ids=ids, use_activation=False)
    assert [o.prompt_token_ids for o in raw] == ids
    for o, w in zip(raw, want):
        torch.testing.assert_close(torch.tensor(o.outputs.probs), w, atol=1e-4, rtol=1e-4)
    # Engine.encode gives the same raw logits (SGLang's reward-model usage of an embedding server)
    for o, w in zip(engine.encode(input_ids=ids), want):
        torch.testing.assert_close(torch.tensor(o["embedding"]), w, atol=1e-4, rtol=1e-4)
    probs = engine.classify([*PROMPTS, LONG])
    n = len(json.loads((path / "config.json").read_text())["id2label"])
    for o, w in zip(probs, want):
        assert o.outputs.num_classes == n
        expect = torch.sigmoid(w) if n == 1 else torch.softmax(w, -1)
        torch.testing.assert_close(torch.tensor(o.outputs.probs), expect, atol=1e-5, rtol=1e-4)


def test_model_has_score_head_and_no_lm_head(engines):
    model = engines["qwen3"].worker.runner.model
    assert model.lm_head is None
    assert tuple(model.score.weight.shape) == (3, 64)


def test_chunked_long_prompt_scores_as_one_chunk(classifier_dirs, engines):
    whole = Engine(str(classifier_dirs["llama"]), is_embedding=True, chunked_prefill_size=512, **ENGINE_KWARGS)
    try:
        one = whole.classify(LONG, use_activation=False)[0].outputs.probs
    finally:
        whole.shutdown()
    chunked = engines["llama"].classify(LONG, use_activation=False)[0].outputs.probs
    assert math.isclose(one[0], chunked[0], abs_tol=1e-4)


def test_bad_requests(engines):
    with pytest.raises(InvalidRequestError) as e:
        engines["llama"].classify([])
    assert e.value.param == "prompts"
    with pytest.raises(InvalidRequestError) as e:
        engines["llama"].classify(input_ids=[[]])
    assert e.value.param == "input"


def test_generation_engine_refuses_classifier(classifier_dirs):
    with pytest.raises(ModelConfigError, match="LlamaForSequenceClassification.*--is-embedding"):
        Engine(str(classifier_dirs["llama"]), **ENGINE_KWARGS)


@pytest.mark.parametrize("arch, model_type", [("LlamaForSequenceClassification", "llama"),
                                              ("MistralForSequenceClassification", "mistral"),
                                              ("Qwen2ForSequenceClassification", "qwen2"),
                                              ("Qwen3ForSequenceClassification", "qwen3")])
def test_architectures_and_labels(arch, model_type):
    raw = {"architectures": [arch], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16}
    assert get_model_class(arch).__name__ == arch
    cfg = ModelConfig.from_dict({**raw, "id2label": {"1": "b", "0": "a"}})
    assert (cfg.model_type, cfg.num_labels) == (model_type, 2)
    assert ModelConfig.from_dict(raw).num_labels == 2  # transformers' default
    assert ModelConfig.from_dict({**raw, "num_labels": 1}).num_labels == 1
    assert classifier_labels({"id2label": {"1": "b", "0": "a"}}) == ("a", "b")
    with pytest.raises(ModelConfigError, match="id2label"):
        ModelConfig.from_dict({**raw, "id2label": {"0": "a", "2": "c"}})
    cfg.check_task(True, "m")
    with pytest.raises(ModelConfigError, match=f"{arch} is a sequence-classification"):
        cfg.check_task(False, "m")


def test_pooler_config_use_activation_is_the_default_a_call_may_override(classifier_dirs):
    """--pooler-config '{"use_activation": false}' makes raw logits the default of classify / /classify; a
    call asking use_activation=True still gets vLLM's activation (softmax over the 3 labels)."""
    path = classifier_dirs["qwen3"]
    engine = Engine(str(path), is_embedding=True, pooler_config={"use_activation": False}, **ENGINE_KWARGS)
    try:
        ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        want = hf_logits(path, ids)
        for o, w in zip(engine.classify(input_ids=ids), want):
            torch.testing.assert_close(torch.tensor(o.outputs.probs), w, atol=1e-4, rtol=1e-4)
        for o, w in zip(engine.classify(input_ids=ids, use_activation=True), want):
            torch.testing.assert_close(torch.tensor(o.outputs.probs), torch.softmax(w, -1), atol=1e-5, rtol=1e-4)
    finally:
        engine.shutdown()
