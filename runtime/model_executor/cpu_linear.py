"""Prepacked oneDNN weights for the bf16 linear layers of a model served on CPU.

F.linear on bf16 CPU tensors reorders the weight into oneDNN's blocked layout on every call; a weight
packed once at load skips that. Measured on one core of an AMD EPYC (AVX512_BF16), [1, 576] inputs:
qkv 0.063 → 0.035 ms, gate_up 0.149 → 0.080 ms, the 49152-row LM head 6.9 → 4.1 ms; [16, 576] inputs
~1.3x; from 256 rows up the same time. The outputs are bit-identical to F.linear's (both are oneDNN).

Only single-rank layers of bf16 models are packed (fp32 keeps MKL's sgemm, the path the HF parity
tests compare). The packed copy lives next to the original weight, which stays the parameter (the
tied LM head shares it with the embedding; load_weights keeps working).

oneDNN builds (and PyTorch's ideep keeps, up to 1024 in an LRU) one primitive per input shape, each
holding ~0.6 MB: a server whose row counts (decode batch sizes, prefill token totals) take every value
grew its RSS by ~2.4 MB per new row count until that cache filled (+600 MB or more, the "leak" of the
CPU soak). Rows are padded up to a few buckets (exact up to 32, then 8 per power of two: at most 12.5%
padding, ~100 shapes up to 16k rows), so the cache stops growing after warm-up."""

from __future__ import annotations

import logging
from types import MethodType

import torch
from torch import nn

from runtime.layers.embedding import ParallelLMHead
from runtime.layers.linear import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)


def packed_linear_available() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


EXACT_ROWS = 32  # row counts served as they are (small decode batches: padding would cost the most)
BUCKETS_PER_OCTAVE_LOG2 = 3  # 8 buckets between each power of two above EXACT_ROWS


def bucket_rows(rows: int) -> int:
    """The row count a `rows`-row input is padded to: itself up to EXACT_ROWS, then the next multiple of
    2^(floor(log2 rows) - 3), which pads by less than 1/8."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 1 - BUCKETS_PER_OCTAVE_LOG2)
    return -(-rows // step) * step


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows = x2.shape[0]
    padded = bucket_rows(rows)
    if padded != rows:  # zero rows: each output row depends on its own input row only
        x2 = torch.cat([x2, x2.new_zeros(padded - rows, shape[-1])])
    y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, bias, "none", [], "")
    return y[:rows].view(*shape[:-1], y.shape[-1])


def _column_forward(self: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    return _linear(x, self.packed_weight, self.bias)


def _row_forward(self: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    y = _linear(x, self.packed_weight, None)
    return y + self.bias if self.bias is not None else y


def _lm_head_logits(self: ParallelLMHead, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _linear(hidden, self.packed_weight, None)[..., : self.vocab_size]  # out unused: the caller copies


def pack_linear_weights(model: nn.Module) -> int:
    """Packs every single-rank bf16 linear layer and LM head of `model` (on CPU); returns how many."""
    if not packed_linear_available():
        return 0
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            continue
        group = getattr(module, "group", None)
        if group is None or group.size != 1:
            continue
        if isinstance(module, ColumnParallelLinear):
            forward = _column_forward
        elif isinstance(module, RowParallelLinear):
            forward = _row_forward
        elif isinstance(module, ParallelLMHead):
            if module.fp8 is not None:  # --fp8-lm-head: its logits come from the fp8 rows
                continue
            module.packed_weight = _pack(weight)
            module.compute_logits = MethodType(_lm_head_logits, module)
            count += 1
            continue
        else:
            continue
        module.packed_weight = _pack(weight)
        module.forward = MethodType(forward, module)
        count += 1
    logger.info("packed %d bf16 linear weights for oneDNN", count)
    return count


def repack_linear_weights(model: nn.Module) -> int:
    """After a live weight update (weight_updater.py): every packed copy packed again from its (updated)
    weight; how many."""
    count = 0
    for module in model.modules():
        if getattr(module, "packed_weight", None) is not None:
            module.packed_weight = _pack(module.weight)
            count += 1
    return count
