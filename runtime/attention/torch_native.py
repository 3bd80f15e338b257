"""TorchNativeAttnBackend: plain torch SDPA per request. The CPU path and the reference for the others."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from runtime.attention.base import AttentionBackend
from runtime.attention.spec import AttentionSpec

if TYPE_CHECKING:
    from runtime.layers.attention import Attention
    from runtime.model_executor.forward_batch import ForwardBatch


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, spec: AttentionSpec):
        self.device = spec.device

    def forward_extend(self, q, k, v, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        return self._run(q, k, v, layer, fb, causal=True)

    def forward_decode(self, q, k, v, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        return self._run(q, k, v, layer, fb, causal=False)

    def _run(self, q, k, v, layer: Attention, fb: ForwardBatch, causal: bool) -> torch.Tensor:
        fb.token_to_kv_pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = fb.token_to_kv_pool.get_kv(layer.layer_id)
        q = q.view(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        table = fb.req_to_token_pool.req_to_token
        rows = fb.req_pool_indices.tolist()
        start = 0
        for i, (seq_len, new) in enumerate(zip(fb.seq_lens_cpu, fb.extend_seq_lens_cpu)):
            slots = table[rows[i], :seq_len].to(torch.int64)
            qi = q[start:start + new].transpose(0, 1)  # [H, new, D]
            ki = k_buf[slots].transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
            vi = v_buf[slots].transpose(0, 1).to(q.dtype)
            mask = None
            window = layer.sliding_window
            if (causal and new > 1) or (window and seq_len > window):
                # New token i sits at position seq_len-new+i and sees every key up to it (within the window).
                pos_q = torch.arange(seq_len - new, seq_len, device=q.device)[:, None]
                pos_k = torch.arange(seq_len, device=q.device)[None, :]
                mask = pos_k <= pos_q
                if window:
                    mask &= pos_k > pos_q - window
            out[start:start + new] = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=layer.scaling, enable_gqa=True).transpose(0, 1)
            start += new
        return out.view(-1, layer.num_heads * layer.head_dim)
