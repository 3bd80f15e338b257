"""Qwen3-Reranker-style serving: a tiny Qwen3ForCausalLM (tied embeddings, as Qwen3-Reranker-0.6B / 4B)
loaded as a classifier by vLLM's --hf-overrides (architectures Qwen3ForSequenceClassification,
classifier_from_token [no, yes], is_original_qwen3_reranker) scores HF's softmax([logit_no, logit_yes])[1]
at the pair's last token (1 token: sigmoid of its logit); an untied LM head (Llama here, as
Qwen3-Reranker-8B) makes the same head from lm_head.weight where the loader passes it; bad overrides are
refused by name."""

from __future__ import annotations

import pytest
import torch
from classify_models import ENGINE_KWARGS

from runtime import Engine
from runtime.errors import ModelConfigError
from runtime.model_config import ModelConfig
from runtime.models.parallel_context import ParallelContext, ParallelGroup
from runtime.models.sequence_classification import LlamaForSequenceClassification

QUERY = "<Instruct>: find it\n<Query>: The capital of France?\n"
DOCS = ["<Document>: Paris is the capital of France.", "<Document>: Hello", "<Document>: emoji: 🙂"]


def overrides(tokens: list[str], arch: str = "Qwen3ForSequenceClassification") -> dict:
    return {"architectures": [arch], "classifier_from_token": tokens, "is_original_qwen3_reranker": True}


@pytest.fixture(scope="module")
def hf_lm(tiny_model_dirs) -> tuple[list[str], list[list[int]], torch.Tensor]:
    """Two tokens of the tiny vocabulary (standing for "no" and "yes"), HF's pair encodings of (QUERY, DOCS),
    and HF's LM logits of those two tokens at each encoding's last token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dirs["qwen3"]
    tok = AutoTokenizer.from_pretrained(str(path))
    no, yes = tok.convert_ids_to_tokens([260, 342])
    ids = [tok(text=QUERY, text_pair=d)["input_ids"] for d in DOCS]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = torch.stack([model(torch.tensor([x])).logits[0, -1, [260, 342]] for x in ids])
    return [no, yes], ids, logits.double()


def test_qwen3_reranker_overrides_match_hf(tiny_model_dirs, hf_lm):
    tokens, ids, logits = hf_lm
    path = str(tiny_model_dirs["qwen3"])
    with Engine(path, is_embedding=True, hf_overrides=overrides(tokens), **ENGINE_KWARGS) as engine:
        assert engine.worker.runner.model_config.classifier_token_ids == (260, 342)
        out = engine.score(QUERY, DOCS)
        assert [o.prompt_token_ids for o in out] == ids
        want = torch.softmax(logits, -1)[:, 1]
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in out], dtype=torch.float64), want,
                                   atol=1e-5, rtol=1e-4)
    with Engine(path, is_embedding=True, hf_overrides=overrides(tokens[1:]), **ENGINE_KWARGS) as engine:
        out = engine.score(QUERY, DOCS, use_activation=False)
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in out], dtype=torch.float64),
                                   logits[:, 1], atol=1e-4, rtol=1e-4)
        # a weight update would keep the score head derived at load: refused, the scores unchanged
        ok, message, _ = engine.update_weights_from_disk(path)
        assert not ok and "classifier_from_token" in message
        again = engine.score(QUERY, DOCS, use_activation=False)
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in again]),
                                   torch.tensor([o.outputs.score for o in out]), atol=1e-5, rtol=1e-5)


def test_untied_lm_head_makes_the_score_row(tiny_model_dirs):
    from safetensors.torch import load_file

    path = tiny_model_dirs["llama"]  # untied
    cfg = ModelConfig.from_pretrained(path, dtype="float32",
                                      overrides=overrides(["<|im_start|>", "<|im_end|>"], "LlamaForSequenceClassification"))
    assert not cfg.tie_word_embeddings and cfg.num_labels == 1
    ckpt = load_file(str(next(path.glob("*.safetensors"))))
    model = LlamaForSequenceClassification(cfg, ParallelContext.tensor_parallel(ParallelGroup.single()))
    model.load_weights(iter(ckpt.items()))
    no, yes = cfg.classifier_token_ids
    torch.testing.assert_close(model.score.weight[0], ckpt["lm_head.weight"][yes] - ckpt["lm_head.weight"][no])
    # and through a server's load, which passes the LM head to such a classifier only (Qwen3-Reranker-8B's case)
    with Engine(str(path), is_embedding=True, hf_overrides=overrides(["<|im_start|>", "<|im_end|>"],
                                                                      "LlamaForSequenceClassification"),
                **ENGINE_KWARGS) as engine:
        torch.testing.assert_close(engine.worker.runner.model.score.weight, model.score.weight)


@pytest.mark.parametrize(("tokens", "match"), [(["a", "b", "c"], "1 or 2 tokens"), ([], "1 or 2 tokens"),
                                               (["not-a-token-here"], "not tokens of")])
def test_bad_classifier_from_token(tiny_model_dirs, tokens, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_pretrained(tiny_model_dirs["qwen3"], overrides=overrides(tokens))


def test_classifier_from_token_needs_a_classifier_architecture(tiny_model_dirs):
    with pytest.raises(ModelConfigError, match="also override architectures"):
        ModelConfig.from_pretrained(tiny_model_dirs["qwen3"], overrides={"classifier_from_token": ["a"]})
