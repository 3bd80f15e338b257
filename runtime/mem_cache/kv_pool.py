"""TokenToKVPool: the K and V tensors of every layer, one row per KV slot (page size 1)."""

from __future__ import annotations

import torch

from runtime.mem_cache.kv_quant import is_fp8, quantize_kv, store_rows
from runtime.mem_cache.kv_rotation import KVRotation
from runtime.mem_cache.kv_scales import KVScales


class TokenToKVPool:
    """Stored in `dtype`: the model dtype, or float8_e4m3fn with a static scale for K and one for V per
    layer (KVScales; runtime/mem_cache/kv_quant.py): writers divide by the scale, readers multiply by it.
    Backends read layer i's floats as k_scales[i] / v_scales[i]. `rotation` (FP8 only; KVRotation): K/V
    are stored in a rotated basis, so whoever writes or reads them (Attention.forward_rotary) rotates q/k/v
    with it first and the output back."""

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str | torch.device, kv_scale: float | KVScales = 1.0, rotation: KVRotation | None = None):
        self.size = size  # usable slots 1..size; slot 0 absorbs writes of padded tokens
        self.dtype = dtype
        self.is_fp8 = is_fp8(dtype)
        scales = kv_scale if isinstance(kv_scale, KVScales) else KVScales.uniform(num_layers, kv_scale)
        if scales.num_layers != num_layers:
            raise ValueError(f"KV scales for {scales.num_layers} layers given to a pool of {num_layers} layers")
        if not self.is_fp8:  # stored in the model dtype: nothing to scale
            scales = KVScales.uniform(num_layers)
        self.scales = scales
        if rotation is not None and (not self.is_fp8 or rotation.num_layers != num_layers):
            raise ValueError("a KV rotation needs an FP8 pool with one rotation per layer")
        self.rotation = rotation
        self.k_scales, self.v_scales = scales.k, scales.v
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def layer_scales(self, layer_id: int) -> tuple[float, float]:
        """(k_scale, v_scale) of one layer: what its kernels take as scalars."""
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kb, vb = self.k_buffers[layer_id], self.v_buffers[layer_id]
        store_rows(kb, loc, quantize_kv(k.view(-1, kb.shape[1], kb.shape[2]), self.k_scales[layer_id], kb.dtype))
        store_rows(vb, loc, quantize_kv(v.view(-1, vb.shape[1], vb.shape[2]), self.v_scales[layer_id], vb.dtype))
