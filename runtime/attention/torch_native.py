"""TorchNativeAttnBackend: the CPU attention backend (and the reference the GPU backends are tested against).

Per batch, init_forward_metadata sorts the requests once into one-token rows (every DECODE request, and
decode rows or one-token chunks inside EXTEND/MIXED batches) and multi-token extend rows. Per layer:
- one-token rows: ONE attention call for all of them, reading K/V in place from the paged pool through
  the req_to_token table (kernels/cpu_decode_attention; without a C compiler, one batched gather +
  matmul in paged_sdpa.decode_attention);
- extend rows: torch's CPU flash kernel per request (causal, prefix merged by log-sum-exp, sliding
  windows in bounded chunks: runtime/attention/paged_sdpa.py).
K/V of the new tokens are stored first, with index_copy_ (a plain scatter, no index_put bookkeeping).
An FP8 pool stores them quantized (kv_quant) and attention sees every key and value as the pool holds it
(stored * scale), a request's own new tokens included: so an output does not depend on whether a token
was computed in this extend, an earlier chunk, a cached prefix or a decode step, and all backends agree
(FlashInfer's paged prefill reads the new tokens from the pool; the Triton backend passes them so)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kernels import cpu_decode_attention
from runtime.attention import paged_sdpa
from runtime.attention.base import AttentionBackend
from runtime.attention.spec import AttentionSpec
from runtime.mem_cache.kv_quant import dequantize_kv, quantize_kv, store_rows

if TYPE_CHECKING:
    from runtime.layers.attention import Attention
    from runtime.mem_cache.kv_pool import TokenToKVPool
    from runtime.model_executor.forward_batch import ForwardBatch


@dataclass(slots=True)
class _ExtendRow:
    row: int  # req_to_token row
    start: int  # first new token in the batch
    n: int  # new tokens
    prefix_len: int


@dataclass(slots=True)
class BatchPlan:
    """What every layer of one batch reuses: which tokens are one-token rows, and their requests."""

    decode_tokens: torch.Tensor | None  # positions of one-token rows in the batch; None: all tokens, in order
    decode_rows: torch.Tensor  # [Bd] req_to_token rows (int64, CPU)
    decode_lens: torch.Tensor  # [Bd] tokens each reads (int64, CPU)
    extend: list[_ExtendRow]
    torch_slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # window → slots, bias

    @property
    def num_decode(self) -> int:
        return self.decode_rows.numel()


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, spec: AttentionSpec):
        self.device = spec.device
        self.req_to_token = spec.req_to_token
        # Decided once: the C kernel runs CPU tensors of its dtypes and shapes; anything else takes the torch path.
        self.use_c_kernel = spec.device.type == "cpu" and cpu_decode_attention.supports(
            spec.dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        self.plan: BatchPlan | None = None
        self._plan_for: ForwardBatch | None = None

    # ---- per batch --------------------------------------------------------------------------------
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self.plan, self._plan_for = self._make_plan(fb), fb

    def _plan_of(self, fb: ForwardBatch) -> BatchPlan:
        if self._plan_for is not fb or self.plan is None:  # a caller that skipped init_forward_metadata
            self.init_forward_metadata(fb)
        return self.plan  # type: ignore[return-value]

    @staticmethod
    def _make_plan(fb: ForwardBatch) -> BatchPlan:
        rows = fb.req_pool_indices.to("cpu", torch.int64)
        if fb.forward_mode.is_decode():
            return BatchPlan(None, rows, torch.tensor(fb.seq_lens_cpu, dtype=torch.int64), [])
        one, extend = [], []
        for i, (n, pre, start) in enumerate(zip(fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu,
                                                fb.extend_start_loc_cpu)):
            if n == 1:
                one.append(i)
            elif n > 1:
                extend.append(_ExtendRow(int(rows[i]), start, n, pre))
        idx = torch.tensor(one, dtype=torch.int64)
        # Indexes q and the output, so it lives on their device (this backend is the GPU tests' reference too).
        tokens = torch.tensor([fb.extend_start_loc_cpu[i] for i in one], dtype=torch.int64, device=fb.input_ids.device)
        lens = torch.tensor([fb.seq_lens_cpu[i] for i in one], dtype=torch.int64)
        return BatchPlan(tokens, rows.index_select(0, idx), lens, extend)

    # ---- per layer --------------------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        return self._run(q, k, v, layer, fb)

    def forward_decode(self, q, k, v, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        return self._run(q, k, v, layer, fb)

    def _run(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: Attention,
             fb: ForwardBatch) -> torch.Tensor:
        plan = self._plan_of(fb)
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        pool = fb.token_to_kv_pool
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        k_scale, v_scale = pool.layer_scales(layer.layer_id)
        if k is None:  # DECODE with K/V stored by the fused rotary + KV store: nothing reads k3/v3
            k3 = v3 = None
        elif pool.is_fp8:
            k8 = quantize_kv(k.reshape(-1, hkv, d).to(q.dtype), k_scale, k_buf.dtype)
            v8 = quantize_kv(v.reshape(-1, hkv, d).to(q.dtype), v_scale, v_buf.dtype)
            store_rows(k_buf, fb.out_cache_loc, k8)
            store_rows(v_buf, fb.out_cache_loc, v8)
            # The new tokens attend to their own K/V as stored, like every later read (module docstring).
            k3, v3 = dequantize_kv(k8, k_scale, q.dtype), dequantize_kv(v8, v_scale, q.dtype)
        else:
            k3 = k.reshape(-1, hkv, d).to(k_buf.dtype)
            v3 = v.reshape(-1, hkv, d).to(v_buf.dtype)
            k_buf.index_copy_(0, fb.out_cache_loc, k3)
            v_buf.index_copy_(0, fb.out_cache_loc, v3)
        q3 = q.reshape(-1, hq, d)
        if plan.decode_tokens is None:  # pure DECODE: the whole batch is one call, in token order
            return self._decode(q3, k_buf, v_buf, layer, plan, pool).view(-1, hq * d)
        out = torch.empty_like(q3)
        if plan.num_decode:
            out[plan.decode_tokens] = self._decode(q3.index_select(0, plan.decode_tokens), k_buf, v_buf, layer, plan,
                                                   pool)
        table = self.req_to_token
        for r in plan.extend:
            s, e = r.start, r.start + r.n
            slots = table[r.row, :r.prefix_len + r.n].to(torch.int64)
            out[s:e] = paged_sdpa.extend_attention(q3[s:e], k3[s:e], v3[s:e], k_buf, v_buf, slots, r.prefix_len,
                                                   layer.scaling, layer.sliding_window, k_scale, v_scale)
        return out.view(-1, hq * d)

    def _decode(self, q3: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: Attention,
                plan: BatchPlan, pool: TokenToKVPool) -> torch.Tensor:
        """All one-token rows of the batch in one call: q3 [Bd, Hq, D] → [Bd, Hq, D]."""
        window = layer.sliding_window
        if self.use_c_kernel and q3.dtype == k_buf.dtype:
            return cpu_decode_attention.paged_decode_attention(
                q3.contiguous(), k_buf, v_buf, self.req_to_token, plan.decode_rows, plan.decode_lens,
                layer.scaling, window)
        if window not in plan.torch_slots:
            plan.torch_slots[window] = paged_sdpa.decode_slots(self.req_to_token.cpu(), plan.decode_rows,
                                                               plan.decode_lens, window)
        slots, bias = plan.torch_slots[window]
        return paged_sdpa.decode_attention(q3, k_buf, v_buf, slots.to(k_buf.device), bias.to(k_buf.device),
                                           layer.scaling, *pool.layer_scales(layer.layer_id))
