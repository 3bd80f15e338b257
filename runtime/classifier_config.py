"""The classifier fields of a config.json (*ForSequenceClassification, and vLLM's classifier_from_token
override that makes a causal LM a one-label classifier, as Qwen3-Reranker is served): which checkpoints are
classifiers, their label names, the override's tokens and their ids in the checkpoint's tokenizer."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.errors import ModelConfigError


def is_classifier_architecture(architecture: str) -> bool:
    """A *ForSequenceClassification checkpoint: a score head over the last token, no LM head."""
    return architecture.endswith("ForSequenceClassification")


def classifier_labels(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """A classifier's label names in class order, as transformers' PretrainedConfig derives them: id2label
    (keys are the class indices, as strings in config.json), else num_labels classes named LABEL_i (2 when
    neither is set); 1 for a causal LM made a classifier by --hf-overrides' classifier_from_token."""
    if classifier_tokens(raw):
        return ("LABEL_0",)
    id2label = raw.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            by_index = {int(k): str(v) for k, v in id2label.items()}
        except (TypeError, ValueError):
            raise ModelConfigError(f"config field 'id2label' must map class indices to names, got {id2label!r}") from None
        if sorted(by_index) != list(range(len(by_index))):
            raise ModelConfigError(f"config field 'id2label' must number its classes 0..n-1, got {sorted(by_index)}")
        return tuple(by_index[i] for i in range(len(by_index)))
    n = raw.get("num_labels", 2)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ModelConfigError(f"config field 'num_labels' must be a positive integer, got {n!r}")
    return tuple(f"LABEL_{i}" for i in range(n))


def classifier_tokens(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """vLLM's classifier_from_token override: 1 token (the score row is its LM-head row) or 2, [false, true]
    (lm_head[true] - lm_head[false]: vLLM's from_2_way_softmax, as Qwen3-Reranker's ["no", "yes"])."""
    tokens = raw.get("classifier_from_token")
    if tokens is None:
        return ()
    if not (isinstance(tokens, list) and len(tokens) in (1, 2) and all(isinstance(t, str) and t for t in tokens)):
        raise ModelConfigError(f"config field 'classifier_from_token' must list 1 or 2 tokens (such as "
                               f'["no", "yes"]), got {tokens!r}')
    return tuple(tokens)


def classifier_token_ids(model_path: str | Path, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of classifier_from_token's tokens in the checkpoint's tokenizer (each one token of its vocab)."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(str(model_path)).get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ModelConfigError(f"classifier_from_token: {missing} not tokens of {model_path}'s vocabulary")
    return tuple(vocab[t] for t in tokens)
