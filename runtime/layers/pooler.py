"""Pooler: an embedding server's prompt hidden states (the final norm's output, before the LM head) → one
vector per request whose prompt ends in this forward; last token, mean or first (CLS) token, then L2
normalization when the model's sentence-transformers config says so.

Chunked prefill splits a prompt across forwards: mean and CLS keep what earlier chunks gave in an fp32
row per request-table row (req_pool_idx), reset by a chunk starting at position 0. That needs every
chunk's tokens computed here: an embedding server with mean or CLS pooling never takes a prompt prefix from
the radix cache (ServerArgs.prefix_cache_for), and a retracted request restarts from position 0. Last-token
pooling reads only the last position, which a cache match always leaves to compute, so it takes prefixes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from runtime.model_executor.forward_batch import ForwardBatch


class Pooler(ABC):
    name: ClassVar[str]

    def __init__(self, normalize: bool, max_reqs: int, hidden_size: int, device: torch.device):
        self.normalize = normalize
        self.max_reqs, self.hidden_size, self.device = max_reqs, hidden_size, device

    def __call__(self, hidden: torch.Tensor, fb: ForwardBatch, done: list[bool]) -> torch.Tensor:
        """[number of True in done, hidden] float32: the vectors of the requests whose prompt ends here, in
        batch order. Every request of the batch is an extend (an embedding server never decodes)."""
        mask = torch.tensor(done, dtype=torch.bool, device=hidden.device)
        pooled = self.pool(hidden, fb, mask)
        return F.normalize(pooled, p=2, dim=-1) if self.normalize else pooled

    @abstractmethod
    def pool(self, hidden: torch.Tensor, fb: ForwardBatch, done: torch.Tensor) -> torch.Tensor:
        """The raw (unnormalized) fp32 vectors of the rows where `done`; keeps running state for the rest."""


class LastTokenPooler(Pooler):
    """The last prompt token's hidden state: it sits in the last chunk, so no state across chunks."""

    name = "last"

    def pool(self, hidden: torch.Tensor, fb: ForwardBatch, done: torch.Tensor) -> torch.Tensor:
        last = fb.extend_start_loc + fb.extend_seq_lens - 1
        return hidden[last[done]].float()


class _RunningPooler(Pooler):
    """A pooler whose vector depends on earlier chunks: one fp32 row of state per request-table row."""

    def __init__(self, normalize: bool, max_reqs: int, hidden_size: int, device: torch.device):
        super().__init__(normalize, max_reqs, hidden_size, device)
        self.state = torch.zeros(max_reqs, hidden_size, dtype=torch.float32, device=device)


class MeanPooler(_RunningPooler):
    """The mean over every prompt token: a running sum over chunks, divided by the prompt length."""

    name = "mean"

    def pool(self, hidden: torch.Tensor, fb: ForwardBatch, done: torch.Tensor) -> torch.Tensor:
        rows = torch.repeat_interleave(torch.arange(fb.batch_size, device=hidden.device), fb.extend_seq_lens,
                                       output_size=fb.extend_num_tokens)
        sums = torch.zeros(fb.batch_size, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, rows, hidden.float())
        # A chunk past position 0 continues the sum its earlier chunks left (no cached prefix: see above).
        carried = self.state[fb.req_pool_indices] * (fb.extend_prefix_lens > 0).unsqueeze(1)
        total = sums + carried
        self.state[fb.req_pool_indices] = total
        return total[done] / fb.seq_lens[done].unsqueeze(1).to(torch.float32)


class ClsPooler(_RunningPooler):
    """The first prompt token's hidden state, kept from the first chunk until the prompt ends."""

    name = "cls"

    def pool(self, hidden: torch.Tensor, fb: ForwardBatch, done: torch.Tensor) -> torch.Tensor:
        first = hidden[fb.extend_start_loc].float()
        starts = (fb.extend_prefix_lens == 0).unsqueeze(1)
        kept = torch.where(starts, first, self.state[fb.req_pool_indices])
        self.state[fb.req_pool_indices] = kept
        return kept[done]


POOLERS: Mapping[str, type[Pooler]] = MappingProxyType({p.name: p for p in (LastTokenPooler, MeanPooler, ClsPooler)})


def create_pooler(pooling_type: str, normalize: bool, max_reqs: int, hidden_size: int,
                  device: torch.device) -> Pooler:
    if pooling_type not in POOLERS:
        raise ValueError(f"unknown pooling type {pooling_type!r}; known: {', '.join(POOLERS)}")
    return POOLERS[pooling_type](normalize, max_reqs, hidden_size, device)
