"""LogitRescore: recompute chosen logits exactly: logits[r, cand[r, j]] = hidden[r] . weight[cand[r, j]].

One program per (row, candidate) reads the candidate's 16-bit weight row and the hidden row and writes the
dot product (fp32 accumulation) straight into the logits, so the candidates' rows are never gathered into
a temporary: the FP8 LM head's rescoring (runtime/layers/head_rescore.py) reads rows x candidates x
hidden x 2 bytes and writes rows x candidates logits.

Measured and not kept: also lowering every other column of a candidate's chunk below its exact value
(so a neighbour FP8 ranked under the leader cannot pass it once the leader is corrected downwards) gave
SmolLM2 (CPU, w8a16 + FP8 head, 48 candidates) 93.65% top-1 agreement against 93.87% without."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rescore_kernel(Logits, Cand, Hidden, W, C, K, stride_l, stride_h, stride_w, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    col = tl.load(Cand + row * C + j)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs = k + tl.arange(0, BLOCK_K)
        mask = offs < K
        h = tl.load(Hidden + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + col * stride_w + offs, mask=mask, other=0.0).to(tl.float32)
        acc += h * w
    tl.store(Logits + row * stride_l + col, tl.sum(acc, 0).to(Logits.dtype.element_ty))


def rescore_logits(logits: torch.Tensor, cand: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """In place: logits [B, V] at columns cand [B, C] (int64) := hidden [B, K] . weight [V, K] rows."""
    rows, c = cand.shape
    if rows == 0 or c == 0:
        return
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    cand = cand.contiguous()
    k = weight.shape[1]
    _rescore_kernel[(rows, c)](logits, cand, hidden, weight, c, k, logits.stride(0), hidden.stride(0),
                               weight.stride(0), BLOCK_K=min(1024, triton.next_power_of_2(k)), num_warps=4)


def rescore_logits_ref(logits: torch.Tensor, cand: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                       rows_at_once: int = 256) -> None:
    """The same with torch: gather the candidates' rows (a bounded number of logit rows at a time) and bmm."""
    for start in range(0, cand.shape[0], rows_at_once):
        c = cand[start:start + rows_at_once]
        h = hidden[start:start + rows_at_once]
        exact = torch.bmm(weight[c].float(), h.float().unsqueeze(-1)).squeeze(-1)
        logits[start:start + rows_at_once].scatter_(1, c, exact.to(logits.dtype))
