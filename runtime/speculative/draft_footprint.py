"""DraftFootprint: device memory a STANDALONE draft model will take next to the target on one rank (its
weights, and its KV bytes per token: its pool has as many slots as the target's), so the target sizes
its own KV pool leaving room for both."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.config import ServerArgs
from runtime.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class DraftFootprint:
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0

    @classmethod
    def of(cls, args: ServerArgs, tp_size: int) -> DraftFootprint:
        if args.speculative_algorithm != "STANDALONE" or not args.speculative_draft_model_path:
            return cls()
        c = ModelConfig.from_pretrained(args.speculative_draft_model_path, dtype=args.dtype)
        size = torch.empty(0, dtype=c.dtype).element_size()
        h, hd, inter = c.hidden_size, c.head_dim, c.intermediate_size
        attn = h * hd * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        mlp = 0
        for layer in range(c.num_hidden_layers):
            if c.moe is not None and c.is_sparse_layer(layer):  # every expert's weights are resident
                m = c.moe
                mlp += m.num_experts * (3 * h * m.moe_intermediate_size + h) + 3 * h * m.shared_expert_intermediate_size
            else:
                mlp += 3 * h * inter
        params = (c.num_hidden_layers * attn + mlp) // tp_size
        params += c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
        kv_heads = max(1, c.num_key_value_heads // tp_size)
        return cls(params * size, 2 * c.num_hidden_layers * kv_heads * hd * size)
