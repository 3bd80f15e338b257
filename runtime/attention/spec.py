"""AttentionSpec: what an attention backend is built from — the per-rank attention shape, the KV
token table and the device — instead of the ModelRunner that happens to hold them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_dim: int
    scaling: float
    dtype: torch.dtype  # activations (and KV unless kv_dtype says otherwise)
    device: torch.device
    req_to_token: torch.Tensor  # [max requests, context + 1] KV slot of each request's token
    max_bs: int  # the most requests one batch holds (sizes workspaces)
    has_sliding_window: bool = False
    kv_dtype: torch.dtype | None = None  # KV pool storage when it differs from dtype (float8_e4m3fn)
