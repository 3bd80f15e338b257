"""Attention layer: holds the per-layer shape facts and hands q/k/v to the batch's attention backend.

forward_rotary also applies the rotary embedding. In a DECODE step on CUDA (unless SHOAL_DECODE_FUSION=0)
it does so with kernels/rotary_kv_store: q rotated in place, k rotated and v copied straight into this
layer's KV pool slots in one launch, and the backend is told the new K/V are already stored (k = v = None).
A pure EXTEND does the same where the backend's extend reads the new K/V back from the pool anyway
(AttentionBackend.extend_reads_kv_from_pool: Triton's over FP8 pools, flashinfer's with its ragged prefill
off), saving the rotary's and the store's own passes over the prefill. Elsewhere (flashinfer's ragged
prefill, MIXED, TARGET_VERIFY, other extends, CPU) the rotary runs on its own and the backend stores.

An FP8 pool with a KVRotation (--kv-cache-rotation) holds K/V in a rotated basis: q/k/v are rotated after
the rotary and the output rotated back, around whichever backend runs. Its fused DECODE path is
kernels/rotary_transform_kv_store (rotary, rotation and store in one launch, the same bits as the
unfused rotary, KVRotation.rotate and the backend's store); rotary_kv_store would store unrotated K. Where
the backend stores (flashinfer's ragged prefill takes the new K/V as given), rotary and rotation still run
as one in-place launch of the same kernel (KVRotation.rotary_rotate_)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.decode_fusion import decode_fusion_enabled

if TYPE_CHECKING:
    from runtime.layers.rotary import RotaryEmbedding
    from runtime.model_executor.forward_batch import ForwardBatch


class Attention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 sliding_window: int = 0):
        super().__init__()
        self.layer_id, self.num_heads, self.num_kv_heads = layer_id, num_heads, num_kv_heads
        self.head_dim, self.scaling = head_dim, scaling
        self.sliding_window = sliding_window  # a query sees only the latest this-many tokens; 0: all
        self.fuse_decode = decode_fusion_enabled()  # read once: a captured graph never mixes the paths

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                fb: ForwardBatch) -> torch.Tensor:
        return fb.attn_backend.forward(q, k, v, self, fb)

    def forward_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       rotary: RotaryEmbedding, fb: ForwardBatch) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] (views of the fused qkv output are fine) before the rotary → o."""
        pool = fb.token_to_kv_pool
        rotation = pool.rotation if pool is not None else None  # None: KVCalibrator's pool-less prefill
        on_device = self._kernel_device(q)
        fusable = self.fuse_decode and on_device and rotary.fusable(self.head_dim)
        fuse = fusable and pool is not None and fb.attn_backend.stores_first_ok(fb)
        if rotation is not None:
            if fuse and rotation.rotary_rotate_and_store(self.layer_id, positions, q, k, v, rotary.cos_sin_cache,
                                                         *pool.get_kv(self.layer_id), fb.out_cache_loc,
                                                         *pool.layer_scales(self.layer_id)):
                return rotation.restore_output(fb.attn_backend.forward(q, None, None, self, fb))
            # The backend stores the new K/V itself (and may attend to them as given): rotary and rotation
            # in one launch where they fuse.
            if not (fusable and rotation.rotary_rotate_(self.layer_id, positions, q, k, v, rotary.cos_sin_cache)):
                q, k = rotary(positions, q, k)
                q, k, v = rotation.rotate(self.layer_id, q, k, v)
            return rotation.restore_output(fb.attn_backend.forward(q, k, v, self, fb))
        if fuse:
            k_buf, v_buf = pool.get_kv(self.layer_id)
            rotary.rotate_and_store(positions, q, k, v, k_buf, v_buf, fb.out_cache_loc,
                                    *pool.layer_scales(self.layer_id))
            return fb.attn_backend.forward(q, None, None, self, fb)
        q, k = rotary(positions, q, k)
        # On CUDA the backends store K/V from strided views (k is one already), so v needs no copy.
        if not (self.fuse_decode and on_device):
            v = v.contiguous()
        return fb.attn_backend.forward(q, k, v, self, fb)

    @staticmethod
    def _kernel_device(q: torch.Tensor) -> bool:
        """Where the fused kernel runs: CUDA (CPU tests lift this to run it in the Triton interpreter)."""
        return q.is_cuda
