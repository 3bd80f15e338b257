"""Attention backends: given q/k/v of new tokens and a ForwardBatch, store K/V in the paged pool and
compute attention over each request's whole sequence. Called by the attention layer; calls kernels."""

from runtime.attention.base import AttentionBackend
from runtime.attention.registry import ATTENTION_BACKENDS, create_attention_backend

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "create_attention_backend"]
