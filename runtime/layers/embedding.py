"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.distributed import ParallelGroup
from runtime.errors import WeightLoadError
from runtime.layers.dense_gemm import DenseGemm
from runtime.layers.fp8_linear import (
    fp8_gemv_serves,
    fp8_linear,
    fused_act_quant_enabled,
    scaled_mm_supported,
)
from runtime.layers.head_rescore import rescore_chunk_leaders, rescore_enabled


@dataclass(frozen=True, slots=True)
class Fp8Head:
    """An LM head's fp8 weight [vocab slice, hidden], its fp32 per-row scales [vocab slice, 1], and how the
    FP8 linears' path runs it (decided once, at load, like theirs)."""
    weight: torch.Tensor
    scale: torch.Tensor
    use_scaled_mm: bool
    weight_only: bool
    act_terms: int
    fused_act_quant: bool
    rescore: bool = True  # each chunk's FP8 leader recomputed from the 16-bit rows (runtime/layers/head_rescore.py)
    # --fp8-lm-head: every call. The default (FP8 weights without the flag) takes the FP8 rows only for the
    # calls the w8a16 GEMV serves (decode at batch 1-2, or 1-16 with --fp8-weight-only): there the head's read
    # is most of its cost and the rescored argmax matched the 16-bit head's on every row measured; a w8a8
    # call quantizes the hidden state too and lost ~1 point of greedy agreement (benchmarks/README.md).
    every_call: bool = True


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, group: ParallelGroup, dtype: torch.dtype | None = None):
        super().__init__()
        self.group, self.vocab_size = group, vocab_size
        self.per_rank = (vocab_size + group.size - 1) // group.size  # last rank padded
        self.start = group.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise WeightLoadError(
                f"tensor {getattr(param, 'hf_name', '')}: checkpoint shape {tuple(loaded.shape)}, "
                f"expected ({self.vocab_size}, {param.shape[1]})")
        param.data[: self.end - self.start].copy_(loaded[self.start:self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mask, input_ids - self.start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T over this rank's vocab slice, gathered to the full vocabulary on every rank."""

    def __init__(self, vocab_size: int, hidden: int, group: ParallelGroup, dtype: torch.dtype | None = None):
        super().__init__(vocab_size, hidden, group, dtype)
        self.gemm = DenseGemm.from_env()
        self.fp8: Fp8Head | None = None

    def use_fp8(self, w8: torch.Tensor, scale: torch.Tensor, act_dtype: torch.dtype, weight_only: bool = False,
                act_terms: int = 1, every_call: bool = True) -> None:
        """--fp8-lm-head: logits from this fp8 copy of the weight (per-row scales) through the FP8 linears'
        path. The 16-bit weight stays: a tied embedding still looks rows up in it, and each chunk's FP8
        leader is recomputed from it (head_rescore.py)."""
        self.fp8 = Fp8Head(w8, scale, scaled_mm_supported(w8.device, act_dtype), weight_only, act_terms,
                           fused_act_quant_enabled(w8.device), rescore_enabled(), every_call)

    def _fp8_serves(self, hidden: torch.Tensor) -> bool:
        f = self.fp8
        return f is not None and (f.every_call or fp8_gemv_serves(hidden, f.weight, f.weight_only))

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: a [rows, vocab] buffer of hidden's dtype the logits may land in directly (a decode graph's
        shared buffer: no copy of ~100 MB a step at 400 rows and 128k vocabulary); whether they did, the
        caller tells by the returned tensor's storage."""
        direct = (out is not None and self.group.size == 1 and self.weight.shape[0] == self.vocab_size
                  and out.dtype == hidden.dtype and out.is_contiguous() and hidden.dim() == 2
                  and tuple(out.shape) == (hidden.shape[0], self.vocab_size))
        if self._fp8_serves(hidden):
            f = self.fp8
            logits = fp8_linear(hidden, f.weight, f.scale, None, f.use_scaled_mm, f.fused_act_quant, f.weight_only,
                                f.act_terms)
            if f.rescore and hidden.dim() == 2:
                logits = rescore_chunk_leaders(logits, hidden, self.weight)
        elif hidden.device.type == "cpu" and hidden.dim() == 2 and 1 < hidden.shape[0] <= 64 \
                and self.weight.dtype == torch.float32:
            # MKL's sgemm for a few rows against the ~50k-row weight is 2-4x slower than the weight-major
            # product (measured, SmolLM2's LM head, 5 rows: 38 → 17 ms); a speculative verify step has 5.
            logits = torch.mm(self.weight, hidden.t()).t()
        else:
            logits = self.gemm(hidden, self.weight, out=out if direct else None)
        if self.group.size > 1:
            logits = self.group.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
