"""ParallelContext: which process group each part of a model is split over.

Plain TP: attention, MLP and vocabulary share one group. DP attention: attention (and the vocabulary)
is replicated per DP rank, the MLP is split over every rank, and each MLP runs on the tokens of all
ranks (gathered, padded to the largest rank's count) so the collectives match even on an IDLE rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from runtime.distributed import ParallelGroup

if TYPE_CHECKING:
    from runtime.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True, slots=True)
class ParallelContext:
    attn: ParallelGroup = field(default_factory=ParallelGroup.single)
    mlp: ParallelGroup = field(default_factory=ParallelGroup.single)
    dp_attention: bool = False

    @property
    def vocab(self) -> ParallelGroup:
        return self.attn

    @classmethod
    def tensor_parallel(cls, group: ParallelGroup) -> ParallelContext:
        return cls(attn=group, mlp=group)

    def with_fast_all_reduce(self, dtype: torch.dtype, device: torch.device, max_tokens: int,
                             hidden_size: int) -> ParallelContext:
        """The same groups, each given a symmetric-memory all-reduce for [max_tokens, hidden] activations
        (the MLP group of DP attention reduces every rank's tokens). Collective on every group."""
        attn = self.attn.with_fast_all_reduce(dtype, device, max_tokens * hidden_size * dtype.itemsize)
        if self.mlp is self.attn:
            return ParallelContext(attn=attn, mlp=attn, dp_attention=self.dp_attention)
        mlp_bytes = max_tokens * self.mlp.size * hidden_size * dtype.itemsize
        return ParallelContext(attn=attn, mlp=self.mlp.with_fast_all_reduce(dtype, device, mlp_bytes),
                               dp_attention=self.dp_attention)

    @property
    def norm_reduce_group(self) -> ParallelGroup | None:
        """The group whose row-parallel outputs the next RMSNorm may all-reduce (None: the linears reduce).
        Only plain TP: under DP attention the MLP's output is sliced back to this rank's tokens first."""
        group = self.mlp
        if self.dp_attention or self.attn is not group or group.fast is None or not group.fast.fuse_norm:
            return None
        return group

    def run_mlp(self, mlp: nn.Module, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if not self.dp_attention:
            return mlp(hidden)
        counts = fb.global_num_tokens
        if counts is None or len(counts) != self.mlp.size:
            raise ValueError("DP attention needs every rank's token count in the batch (global_num_tokens)")
        width = max(max(counts), 1)
        local = hidden.shape[0]
        padded = hidden.new_zeros((width, hidden.shape[1]))
        padded[:local] = hidden
        out = mlp(self.mlp.all_gather(padded, dim=0))
        start = self.mlp.rank * width
        return out[start:start + local]
