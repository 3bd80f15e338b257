"""ParallelGroup: one torch.distributed group (or none, for a single rank) with the collectives TP needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch ProcessGroup; None when size == 1

    @classmethod
    def single(cls) -> ParallelGroup:
        return cls()

    @property
    def is_trivial(self) -> bool:
        return self.size == 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's x along dim (all ranks pass the same shape)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if dist.get_backend(self.group) == "nccl":
            out = torch.empty((self.size,) + x.shape, dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = list(out.unbind(0))
        else:  # gloo has no all_gather_into_tensor
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src_rank: int = 0) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, group_src=src_rank, group=self.group)
        return x
