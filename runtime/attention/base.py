"""AttentionBackend ABC. Backends own their CUDA-graph hooks, so CudaGraphRunner stays generic."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.layers.attention import Attention
    from runtime.model_executor.forward_batch import ForwardBatch
    from runtime.model_executor.forward_mode import ForwardMode


class AttentionBackend(ABC):
    supports_cuda_graph: bool = False
    supports_verify_cuda_graph: bool = False  # TARGET_VERIFY (K + 1 tokens per request) captured too

    def extend_reads_kv_from_pool(self, fb: ForwardBatch) -> bool:
        """Whether this batch's pure-EXTEND attention reads the new tokens' K/V back from the pool, so the
        caller may store them first (k = v = None), as in DECODE."""
        return False

    def stores_first_ok(self, fb: ForwardBatch) -> bool:
        """Whether forward takes k = v = None (the caller stored the new K/V) for this batch."""
        mode = fb.forward_mode
        return mode.is_decode() or (mode.is_pure_extend() and self.extend_reads_kv_from_pool(fb))

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Once per batch, before the layers run (plan kernels, build index tensors)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: Attention,
                fb: ForwardBatch) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] → o [T, Hq*D]. Stores K/V at fb.out_cache_loc first; k = v = None
        (DECODE; a pure EXTEND too where extend_reads_kv_from_pool) says the caller already stored them
        (Attention.forward_rotary's fused kernel)."""
        if fb.forward_mode.is_idle():
            return q.new_empty((0, layer.num_heads * layer.head_dim))
        if (k is None) != (v is None) or (k is None and not self.stores_first_ok(fb)):
            where = "DECODE or EXTEND" if self.extend_reads_kv_from_pool(fb) else "DECODE"
            raise ValueError(f"k and v may be None (already stored) together and only in {where}, not "
                             f"{fb.forward_mode.name} ({type(self).__name__})")
        if fb.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, fb)
        return self.forward_extend(q, k, v, layer, fb)

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
                       fb: ForwardBatch) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
                       fb: ForwardBatch) -> torch.Tensor: ...

    # CUDA-graph hooks: static buffers sized for the largest captured batch, filled per replay.
    def init_cuda_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor, forward_mode: ForwardMode,
                                                 tokens_per_req: int = 1) -> None:
        raise NotImplementedError

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int,
                                                forward_mode: ForwardMode, seq_lens_cpu: list[int] | None = None
                                                ) -> None:
        """seq_lens_cpu: the same lengths on the host, so a backend can plan without a device sync."""
        raise NotImplementedError

    def _check_graph_mode(self, forward_mode: ForwardMode) -> None:
        if forward_mode.is_decode() or (forward_mode.is_target_verify() and self.supports_verify_cuda_graph):
            return
        raise NotImplementedError(f"{type(self).__name__} does not capture {forward_mode.name} in CUDA graphs")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_len given to padded rows of a replayed batch (they read slot 0)."""
        return 1
