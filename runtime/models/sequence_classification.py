"""*ForSequenceClassification: reward and classification models (Skywork-Reward-Llama-3.1-8B, Qwen2.5 /
Qwen3 classifiers). The decoder of the causal class, no LM head, and HF's `score` [num_labels, hidden]
(no bias) over the final norm's output. HF scores the last non-pad token of each row; an embedding server
has no padding, so the server's last-token pooler picks the prompt's last row of these logits (the
default; --pooler-config MEAN / CLS pools the rows instead, never normalized: text/pooling_config.py). A causal checkpoint
served as one through --hf-overrides' classifier_from_token (Qwen3-Reranker) gets its score head made from
LM-head rows at load."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from runtime.errors import WeightLoadError
from runtime.model_config import ModelConfig
from runtime.models.llama import LlamaForCausalLM
from runtime.models.parallel_context import ParallelContext

if TYPE_CHECKING:
    from runtime.model_executor.forward_batch import ForwardBatch


class LlamaForSequenceClassification(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, embedding_only: bool = True):
        """embedding_only is always true here: the model has a score head and no LM head, whatever the caller
        asks (a generation server refuses these architectures first: ModelConfig.check_task)."""
        super().__init__(cfg, ctx, embedding_only=True)
        if cfg.num_labels < 1:
            raise ValueError(f"{cfg.architecture} needs num_labels >= 1 (config.json's id2label / num_labels)")
        # Replicated on every TP rank: the final norm's output is whole there, and num_labels rows are tiny.
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False, dtype=cfg.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """[tokens, num_labels]: every token's logits; [tokens x num_labels] costs far less than the decoder,
        and the pooler keeps only each finished prompt's last row."""
        return self.score(self.model(input_ids, positions, fb))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A checkpoint's own score head as it is; for a causal LM served as a classifier by --hf-overrides'
        classifier_from_token (Qwen3-Reranker), the head vLLM makes of the LM head's rows of those tokens:
        the one row, or lm_head[true] - lm_head[false] (sigmoid of it = softmax over (false, true) of true).
        The rows are taken from the whole checkpoint tensor as it passes (an untied lm_head.weight, else the
        tied embed_tokens), so a vocab-parallel shard never matters."""
        ids = self.cfg.classifier_token_ids
        if not ids:
            super().load_weights(weights)
            return
        rows: dict[str, torch.Tensor] = {}

        def with_score() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in ("lm_head.weight", "model.embed_tokens.weight"):
                    rows[name] = tensor[list(ids)].to(torch.float32)
                if name == "score.weight":  # --load-format dummy draws the head itself
                    rows[name] = tensor
                if name != "lm_head.weight":
                    yield name, tensor
            if "score.weight" in rows:
                return
            source = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
            if source not in rows:
                raise WeightLoadError(f"classifier_from_token makes the score head of the checkpoint's {source}, "
                                      "which the checkpoint does not have")
            r = rows[source]
            yield "score.weight", (r[1] - r[0] if len(ids) == 2 else r[0]).unsqueeze(0)

        super().load_weights(with_score())


class MistralForSequenceClassification(LlamaForSequenceClassification):
    pass


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    pass


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    pass
