"""ParallelGroup: one torch.distributed group (or none, for a single rank) with the collectives TP needs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.distributed.symm_mem_all_reduce import SymmMemAllReduce


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch ProcessGroup; None when size == 1
    fast: SymmMemAllReduce | None = None  # small all-reduces inside CUDA graphs; NCCL does the rest

    @classmethod
    def single(cls) -> ParallelGroup:
        return cls()

    @property
    def is_trivial(self) -> bool:
        return self.size == 1

    @property
    def all_reduce_kind(self) -> str:
        """What sums activations across the ranks: "none" (one rank), "symm_mem+<backend>" (the one-shot
        kernel inside CUDA graphs, the backend elsewhere) or the process group's backend alone."""
        if self.size == 1:
            return "none"
        backend = str(dist.get_backend(self.group))
        return f"symm_mem+{backend}" if self.fast is not None else backend

    def with_fast_all_reduce(self, dtype: torch.dtype, device: torch.device, max_bytes: int) -> ParallelGroup:
        """This group plus a symmetric-memory all-reduce when the machine allows (collective)."""
        if self.size == 1 or self.fast is not None:
            return self
        return dataclasses.replace(self, fast=SymmMemAllReduce.create(self.group, dtype, device, max_bytes))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks. Use the return value: the fast path answers in a new tensor."""
        if self.size > 1:
            if self.fast is not None and self.fast.can_run(x):
                return self.fast(x)
            dist.all_reduce(x, group=self.group)
        return x

    def defers_to_norm(self, x: torch.Tensor) -> bool:
        """Whether a row-parallel linear whose output x goes straight into an RMSNorm should leave x
        unreduced, for the norm to all-reduce, add and normalise in one launch (add_rmsnorm_reduced)."""
        return self.size > 1 and self.fast is not None and self.fast.can_add_rmsnorm(x)

    def add_rmsnorm_reduced(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float) -> torch.Tensor:
        """rmsnorm(residual + all_reduce(x)) * weight, residual updated in place; only where
        defers_to_norm(x) (collective)."""
        assert self.fast is not None
        return self.fast.add_rmsnorm(x, residual, weight, eps)

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
