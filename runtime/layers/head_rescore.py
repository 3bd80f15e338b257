"""HeadRescore: an FP8 LM head's logits with every chunk's leader recomputed from the 16-bit rows.

Why: an FP8 row (one scale per row) moves a logit by up to ~1% of its size, enough to swap near-tied
leaders: on SmolLM2 the FP8 head cost ~3 points of greedy top-1 agreement with bf16 (w8a16 95.14% ->
92.07%, benchmarks/results/fp8_lm_head_accuracy_cpu.json). The row's true leader is the leader of its
chunk of columns, so recomputing each chunk's FP8 leader exactly (hidden . 16-bit row, which the head keeps
for a tied embedding anyway) and writing it back over the FP8 value gives the greedy token bf16 gives,
unless the true leader and a near-tie that FP8 ranks above it share a chunk. Sampling sees exact logits
for the candidates and FP8 ones for the tail. While a call has at most TOPK_ROWS rows each chunk gives its
TOPK leaders, since FP8's error often reorders a chunk's top few. SHOAL_FP8_HEAD_RESCORE=0 turns it off.
The candidates' rows are read by kernels/logit_rescore.py on CUDA (no gathered copy), by a bounded torch
gather elsewhere: MAX_CANDIDATES chunks a row, so rows x 64 (x TOPK up to TOPK_ROWS rows) x hidden x 2
bytes a call (the 8B shape: 2 MB at batch 1, 132 MB at 64 rows with 4 leaders and at 256 rows with one,
~45 us of HBM against the 0.5 GB the FP8 head saves a step)."""

from __future__ import annotations

import os

import torch
import triton

from kernels.argmax import chunk_argmax
from kernels.logit_rescore import rescore_logits, rescore_logits_ref

MAX_CANDIDATES = 64  # chunks a row
# Leaders kept per chunk while a call has at most TOPK_ROWS rows: FP8's error on a logit (median of a row's
# largest ~1.25 on SmolLM2's tied head, as large as the median top-1 margin) often puts a neighbour above
# the true leader inside its chunk. SmolLM2, CPU: with 4 leaders the rescored argmax was the 16-bit head's
# on all 4,096 rows, with one 90 rows differed (benchmarks/head_rescore_diag.py). Up to 64 rows the 4 x 63
# rows a row read on Llama-3's head (132 MB at 64 rows, ~45 us) stay well under the ~0.5 GB the FP8 head
# saves a step; above, one leader a chunk.
TOPK, TOPK_ROWS = 4, 64


def rescore_enabled() -> bool:
    return os.environ.get("SHOAL_FP8_HEAD_RESCORE", "1") != "0"


def candidate_block(vocab: int) -> int:
    """Columns per chunk: the power of two that leaves at most MAX_CANDIDATES chunks (at least 16 columns)."""
    return max(16, triton.next_power_of_2(triton.cdiv(vocab, MAX_CANDIDATES)))


def candidates(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B, C]: the columns rescore_chunk_leaders recomputes in these FP8 logits (each chunk's TOPK
    leaders while the call has at most TOPK_ROWS rows, its leader above)."""
    return chunk_argmax(logits, candidate_block(logits.shape[1]), TOPK if logits.shape[0] <= TOPK_ROWS else 1)


def rescore_chunk_leaders(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (from the FP8 rows) with each chunk's leading column (its TOPK leading columns at up to
    TOPK_ROWS rows) replaced by hidden [B, K] . weight [V, K] (the 16-bit rows), in place; returns logits."""
    if logits.dim() != 2 or hidden.dim() != 2 or logits.shape[0] != hidden.shape[0]:
        raise ValueError(f"rescore: logits {tuple(logits.shape)} and hidden {tuple(hidden.shape)} do not pair")
    rows = logits.shape[0]
    if rows == 0:
        return logits
    cand = candidates(logits)
    if logits.is_cuda:
        rescore_logits(logits, cand, hidden, weight)
    else:
        rescore_logits_ref(logits, cand, hidden, weight)
    return logits
