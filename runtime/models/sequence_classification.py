"""*ForSequenceClassification: reward and classification models (Skywork-Reward-Llama-3.1-8B, Qwen2.5 /
Qwen3 classifiers). The decoder of the causal class, no LM head, and HF's `score` [num_labels, hidden]
(no bias) over the final norm's output. HF scores the last non-pad token of each row; an embedding server
has no padding, so the server's last-token pooler picks the prompt's last row of these logits
(text/pooling_config.py forces last-token pooling, unnormalized, for these architectures)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

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


class MistralForSequenceClassification(LlamaForSequenceClassification):
    pass


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    pass


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    pass
