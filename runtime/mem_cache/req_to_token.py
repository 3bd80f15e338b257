"""ReqToTokenPool: request slot → the KV slot index of each of its tokens."""

from __future__ import annotations

import torch

from runtime.errors import DoubleFreeError


class ReqToTokenPool:
    """A [max_reqs, max_context_len] table. The scheduler's copy (CPU) hands out rows; each worker keeps
    a device copy that it fills from the WorkerBatch, so attention kernels can gather a request's KV."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self._free_slots = list(range(size))
        self._is_free = [True] * size

    def available_size(self) -> int:
        return len(self._free_slots)

    def alloc(self, n: int = 1) -> list[int] | None:
        if n > len(self._free_slots):
            return None
        out, self._free_slots = self._free_slots[:n], self._free_slots[n:]
        for i in out:
            self._is_free[i] = False
        return out

    def free(self, idx: int) -> None:
        if self._is_free[idx]:
            raise DoubleFreeError(f"request slot {idx} freed twice")
        self._is_free[idx] = True
        self._free_slots.append(idx)

    def write(self, idx: int, start: int, kv_indices: torch.Tensor) -> None:
        self.req_to_token[idx, start:start + kv_indices.numel()] = kv_indices.to(self.req_to_token.dtype)

    def read(self, idx: int, end: int, start: int = 0) -> torch.Tensor:
        return self.req_to_token[idx, start:end].to(torch.int64)
