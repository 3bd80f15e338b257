"""RaggedPrefill: the flashinfer backend's EXTEND / MIXED attention as SGLang runs it: the new tokens attend
to each other through flashinfer's ragged prefill over their K/V as the layer computed them (fa3 on Hopper),
and to each request's cached prefix through the paged prefill over the pool's prefix slots only; the two
partial results merge by their log-sum-exp.

Why: the paged prefill over every key (the new ones read back from the pool) is flashinfer's FA2 kernel with
page size 1, which ran a 1,400-token prompt wave at ~170 TFLOP/s over an FP8 pool and ~220 over bf16 (one
H100, svc_step_times_profile_{fp8_kv,bf16}_wave_h100.json: 1.23 s of a 14.1 s FP8 prefill). The new tokens'
own attention is most of a prompt's: it runs on contiguous bf16 K/V, where FA3 applies. Over an FP8 pool the
new tokens then see each other's bf16 K/V (the stored FP8 copy serves every later step), as in SGLang: closer
to bf16, but an FP8 run's prompt now reads FP8 only where a chunk boundary or a cache hit splits it, so its
outputs depend on those splits (prompt logprobs of an unsplit prompt carry no FP8 error at all).

SHOAL_PREFILL_RAGGED: auto (default; flashinfer picks fa3 where it applies), fa2, fa3, or 0 (the paged
prefill over every key, as before)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from runtime.model_executor.forward_batch import ForwardBatch

CHOICES = ("auto", "fa2", "fa3", "0")


def ragged_prefill_choice() -> str:
    choice = os.environ.get("SHOAL_PREFILL_RAGGED", "auto")
    if choice not in CHOICES:
        raise ValueError(f"SHOAL_PREFILL_RAGGED={choice!r}: expected one of {', '.join(CHOICES)}")
    return choice


def check_kernel_backend(choice: str, capability: tuple[int, int] | None) -> None:
    """fa3 is Hopper's (sm90) kernel family: asked for elsewhere, say so at start-up rather than in
    flashinfer's first plan. capability None: no CUDA device to ask."""
    if choice == "fa3" and capability is not None and capability[0] != 9:
        raise ValueError(f"SHOAL_PREFILL_RAGGED=fa3 needs a Hopper GPU (sm90); this one is sm{capability[0]}"
                         f"{capability[1]}: use auto (what it picks) or fa2")


def serves(fb: ForwardBatch) -> bool:
    """Batches it runs: a plain prefill and a prefill with decode rows (one new token each). Speculative
    modes keep the paged prefill (their graphs and masks are planned there)."""
    mode = fb.forward_mode
    return mode.is_pure_extend() or mode.is_mixed()


class RaggedPrefill:
    """Plans once per batch (plan), runs per layer (run). The paged wrapper is the backend's own, planned
    here over the prefixes only when some request has one."""

    def __init__(self, flashinfer: Any, workspace: torch.Tensor, paged_wrapper: Any, kernel_backend: str,
                 num_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float, dtype: torch.dtype,
                 kv_dtype: torch.dtype, device: torch.device):
        check_kernel_backend(kernel_backend, torch.cuda.get_device_capability(device) if device.type == "cuda"
                             else None)
        self._fi = flashinfer
        self.wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=kernel_backend)
        self.paged = paged_wrapper
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sm_scale, self.dtype, self.kv_dtype, self.device = sm_scale, dtype, kv_dtype, device
        self._span: PrefixSpan | None = None
        self._tokens = (0, 0)  # the span's new tokens
        self._rows = torch.empty(0, dtype=torch.bool)  # which of them belong to a request with a prefix

    def load_modules(self, one: torch.Tensor, slot: torch.Tensor) -> None:
        """Plans a one-token batch on both wrappers and merges one row, which loads (on a machine's first use
        JIT-compiles, 10-75 s each) the kernels every batch needs: at start-up, not when the first cached
        prefix shows up mid-run (one H100 run stalled 28 s there on the paged module; an H200 run's prefill
        took 10 s longer with the merge's module compiled mid-run). one: pinned host indptr [0, 1]; slot: a
        device index [1]."""
        self.wrapper.plan(one, one, self.num_heads, self.num_kv_heads, self.head_dim, causal=True,
                          sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        self.paged.plan(one, one, slot, one[1:], self.num_heads, self.num_kv_heads, self.head_dim, 1, causal=False,
                        sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=self.kv_dtype)
        o = torch.zeros(1, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
        lse = torch.zeros(1, self.num_heads, dtype=torch.float32, device=self.device)
        self._fi.merge_state_in_place(o, lse, o.clone(), lse.clone(),
                                      mask=torch.ones(1, dtype=torch.bool, device=self.device))

    def plan(self, fb: ForwardBatch, qo_indptr: torch.Tensor, span: PrefixSpan | None) -> None:
        """qo_indptr: pinned host offsets of each request's new tokens; span: the requests with a cached
        prefix (prefix_span) and their slots, None when no request has one."""
        self.wrapper.plan(qo_indptr, qo_indptr, self.num_heads, self.num_kv_heads, self.head_dim, causal=True,
                          sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        self._span = span
        if span is None:
            return
        # Only the span's tokens go through the paged prefill, and each sees its request's whole prefix.
        first, last = span.requests
        self.paged.plan(span.qo_indptr, span.kv_indptr, span.kv_indices, span.last_page_len, self.num_heads,
                        self.num_kv_heads, self.head_dim, 1, causal=False, sm_scale=self.sm_scale,
                        q_data_type=self.dtype, kv_data_type=self.kv_dtype)
        self._tokens = (int(qo_indptr[first]), int(qo_indptr[last]))
        lens = fb.extend_seq_lens_cpu[first:last]
        rows = torch.tensor([p > 0 for p in fb.extend_prefix_lens_cpu[first:last]], dtype=torch.bool)
        rows = rows.repeat_interleave(torch.tensor(lens, dtype=torch.int64))
        self._rows = rows.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else rows

    def run(self, q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
            scales: dict[str, float]) -> torch.Tensor:
        """q3 [T, Hq, D], k3/v3 [T, Hkv, D] (the new tokens, in q's dtype) → o [T, Hq, D]; k_buf/v_buf the
        layer's pool (the prefixes), read with `scales` when FP8."""
        o, lse = self.wrapper.run(q3, k3, v3, return_lse=True)
        if self._span is not None:
            a, b = self._tokens
            o_prefix, lse_prefix = self.paged.run(q3[a:b], (k_buf.unsqueeze(1), v_buf.unsqueeze(1)),
                                                  return_lse=True, **scales)
            # Rows without a prefix inside the span keep their ragged result (their paged part is empty).
            self._fi.merge_state_in_place(o[a:b], lse[a:b], o_prefix, lse_prefix, mask=self._rows)
        return o


@dataclass(frozen=True, slots=True)
class PrefixSpan:
    """Requests first..last-1 (every request with a cached prefix lies among them): their new tokens'
    offsets (qo_indptr) and their prefixes' slots (kv_indptr), both pinned on the host; kv_indices on the
    device; last_page_len ones (page size 1). flashinfer's planner counts (pages - 1, clamped at 0) +
    last_page_len keys, so a request without a prefix inside the span reads one stray key: its rows are
    masked out of the merge (a 0 there would give the kernel a length of -1; ones are what ran on a GPU)."""
    requests: tuple[int, int]
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor


def prefix_span(prefix_lens: list[int]) -> tuple[int, int] | None:
    """(first, last + 1) of the requests with a prefix (a chunked prefill's continued request usually
    leads the batch, so the paged part covers it alone), or None."""
    with_prefix = [i for i, p in enumerate(prefix_lens) if p > 0]
    return (with_prefix[0], with_prefix[-1] + 1) if with_prefix else None
