"""KVAllocator: hands out KV slot indices one token at a time (page size 1)."""

from __future__ import annotations

import torch

from runtime.errors import DoubleFreeError


class KVAllocator:
    """Free-list of slots 1..size. Slot 0 is never handed out: padded batches write their junk K/V there.

    Lives on the CPU with the scheduler; the KV tensors themselves live with the workers.
    """

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"KV pool size must be positive, got {size}")
        self.size = size
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._is_free = torch.ones(size + 1, dtype=torch.bool)
        self._is_free[0] = False

    def available_size(self) -> int:
        return int(self._free.numel())

    def used_size(self) -> int:
        return self.size - self.available_size()

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slot indices, or None when fewer than n are free (the scheduler evicts or retracts)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        self._is_free[out] = False
        return out

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel() == 0:
            return
        indices = indices.to(torch.int64).flatten()
        if bool((indices < 1).any()) or bool((indices > self.size).any()):
            raise DoubleFreeError(f"freeing slot outside 1..{self.size}")
        if bool(self._is_free[indices].any()) or indices.unique().numel() != indices.numel():
            bad = indices[self._is_free[indices]][:8].tolist()
            raise DoubleFreeError(f"KV slots freed twice: {bad or 'duplicate indices in one call'}")
        self._is_free[indices] = True
        self._free = torch.cat([self._free, indices])

    def clear(self) -> None:
        self.__init__(self.size)
