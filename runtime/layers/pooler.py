"""Pooler: an embedding server's per-token model outputs → one raw vector per request whose prompt ends in
this forward: the last token's, the mean over the prompt, or the first (CLS) token's. The outputs are an
embedder's final norm output (before the LM head) or a *ForSequenceClassification model's per-token score
logits; the width is whatever the model emits. Pooling a classifier's logits rather than its hidden states
is exact: the score head is linear without bias, so mean(h) @ W.T == mean(h @ W.T), and the model already
scores every token (tokens x num_labels, negligible beside the decoder); the running state is then
num_labels wide and neither the model nor the runner changes. The vectors leave unnormalized: L2
normalization is a request's choice (vLLM's normalize / use_activation, the model's by default), applied
where the gateway or Engine gets them back (PoolingConfig.shorten), since a normalized vector cannot be
made raw again.

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

if TYPE_CHECKING:
    from runtime.model_executor.forward_batch import ForwardBatch


class Pooler(ABC):
    name: ClassVar[str]

    def __init__(self, max_reqs: int, device: torch.device):
        self.max_reqs, self.device = max_reqs, device

    def __call__(self, hidden: torch.Tensor, fb: ForwardBatch, done: list[bool]) -> torch.Tensor:
        """[number of True in done, width] float32: the raw vectors of the requests whose prompt ends here,
        in batch order. Every request of the batch is an extend (an embedding server never decodes)."""
        mask = torch.tensor(done, dtype=torch.bool, device=hidden.device)
        return self.pool(hidden, fb, mask)

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

    def __init__(self, max_reqs: int, device: torch.device):
        super().__init__(max_reqs, device)
        self._state: torch.Tensor | None = None

    def state(self, width: int) -> torch.Tensor:
        """[max_reqs, width] fp32, made at the first forward: its width is the model's output's (hidden size,
        or a classifier's num_labels), which the runner need not know."""
        if self._state is None or self._state.shape[1] != width:
            self._state = torch.zeros(self.max_reqs, width, dtype=torch.float32, device=self.device)
        return self._state


class MeanPooler(_RunningPooler):
    """The mean over every prompt token: a running sum over chunks, divided by the prompt length."""

    name = "mean"

    def pool(self, hidden: torch.Tensor, fb: ForwardBatch, done: torch.Tensor) -> torch.Tensor:
        rows = torch.repeat_interleave(torch.arange(fb.batch_size, device=hidden.device), fb.extend_seq_lens,
                                       output_size=fb.extend_num_tokens)
        sums = torch.zeros(fb.batch_size, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, rows, hidden.float())
        # A chunk past position 0 continues the sum its earlier chunks left (no cached prefix: see above).
        state = self.state(hidden.shape[-1])
        carried = state[fb.req_pool_indices] * (fb.extend_prefix_lens > 0).unsqueeze(1)
        total = sums + carried
        state[fb.req_pool_indices] = total
        return total[done] / fb.seq_lens[done].unsqueeze(1).to(torch.float32)


class ClsPooler(_RunningPooler):
    """The first prompt token's hidden state, kept from the first chunk until the prompt ends."""

    name = "cls"

    def pool(self, hidden: torch.Tensor, fb: ForwardBatch, done: torch.Tensor) -> torch.Tensor:
        first = hidden[fb.extend_start_loc].float()
        starts = (fb.extend_prefix_lens == 0).unsqueeze(1)
        state = self.state(hidden.shape[-1])
        kept = torch.where(starts, first, state[fb.req_pool_indices])
        state[fb.req_pool_indices] = kept
        return kept[done]


POOLERS: Mapping[str, type[Pooler]] = MappingProxyType({p.name: p for p in (LastTokenPooler, MeanPooler, ClsPooler)})


def create_pooler(pooling_type: str, max_reqs: int, device: torch.device) -> Pooler:
    if pooling_type not in POOLERS:
        raise ValueError(f"unknown pooling type {pooling_type!r}; known: {', '.join(POOLERS)}")
    return POOLERS[pooling_type](max_reqs, device)
