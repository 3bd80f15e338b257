"""TokenToKVPool: the K and V tensors of every layer, one row per KV slot (page size 1)."""

from __future__ import annotations

import torch

from runtime.mem_cache.kv_quant import is_fp8, quantize_kv, store_rows


class TokenToKVPool:
    """Stored in `dtype`: the model dtype, or float8_e4m3fn with one static scale for K and one for V
    (runtime/mem_cache/kv_quant.py): writers divide by the scale, readers multiply by it."""

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str | torch.device, kv_scale: float = 1.0):
        self.size = size  # usable slots 1..size; slot 0 absorbs writes of padded tokens
        self.dtype = dtype
        self.is_fp8 = is_fp8(dtype)
        self.k_scale = self.v_scale = float(kv_scale) if self.is_fp8 else 1.0
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kb, vb = self.k_buffers[layer_id], self.v_buffers[layer_id]
        store_rows(kb, loc, quantize_kv(k.view(-1, kb.shape[1], kb.shape[2]), self.k_scale, kb.dtype))
        store_rows(vb, loc, quantize_kv(v.view(-1, vb.shape[1], vb.shape[2]), self.v_scale, vb.dtype))
