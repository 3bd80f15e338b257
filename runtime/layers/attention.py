"""Attention layer: holds the per-layer shape facts and hands q/k/v to the batch's attention backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from runtime.model_executor.forward_batch import ForwardBatch


class Attention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 sliding_window: int = 0):
        super().__init__()
        self.layer_id, self.num_heads, self.num_kv_heads = layer_id, num_heads, num_kv_heads
        self.head_dim, self.scaling = head_dim, scaling
        self.sliding_window = sliding_window  # a query sees only the latest this-many tokens; 0: all

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return fb.attn_backend.forward(q, k, v, self, fb)
