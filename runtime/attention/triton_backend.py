"""TritonAttnBackend: our kernels/ attention on the paged token-level KV pool.

EXTEND and MIXED batches run extend_attention_fwd (a decode request inside a MIXED batch is an extend
request with one new token); DECODE runs the split-KV decode_attention_fwd (one launch per layer with
the decode fusions on: the last split merges, kernels/decode_attention.py) through TritonDecode
(runtime/attention/triton_decode.py: its launch config per KV dtype, and its scratch, allocated once for
the largest batch the runner can hold, so eager steps allocate nothing and a captured CUDA graph always
sees the same buffer). K/V are stored with store_kv before attention (quantized when the pool stores FP8;
the kernels read it back with the pool's scales). With FP8 the extend kernel gets the new tokens' K/V read
back from the pool too (one small gather + dequantize per layer), so they attend to themselves exactly as
any later step will see them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.decode_fusion import decode_fusion_enabled
from kernels.extend_attention import extend_attention_fwd
from kernels.kv_store import store_kv
from kernels.verify_attention import MAX_ROWS as VERIFY_MAX_TOKENS
from kernels.verify_attention import verify_attention_fwd, verify_attention_workspace
from runtime.attention.base import AttentionBackend
from runtime.attention.spec import AttentionSpec
from runtime.attention.triton_decode import DecodeKernelConfig, TritonDecode
from runtime.mem_cache.kv_quant import dequantize_kv, gather_rows

if TYPE_CHECKING:
    from runtime.layers.attention import Attention
    from runtime.model_executor.forward_batch import ForwardBatch
    from runtime.model_executor.forward_mode import ForwardMode


class TritonAttnBackend(AttentionBackend):
    supports_cuda_graph = True
    # TARGET_VERIFY runs the verify kernel (K + 1 causal rows per request, split-KV like decode; it reads
    # lengths and offsets on device): it captures as is.
    supports_verify_cuda_graph = True

    def __init__(self, spec: AttentionSpec, num_kv_splits: int | None = None):
        self.device: torch.device = spec.device
        self.req_to_token: torch.Tensor = spec.req_to_token
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        kv_fp8 = spec.kv_dtype is not None and spec.kv_dtype.itemsize == 1
        self.decode = TritonDecode(spec, DecodeKernelConfig.for_kv(kv_fp8, num_kv_splits))
        self.num_kv_splits = self.decode.config.max_splits
        # DECODE in one launch per layer (stage 2 merged in by the last split).
        self.fuse_merge = decode_fusion_enabled()
        # The captured verify graphs' scratch, sized once at capture (largest first); never replaced after.
        self._verify_workspace: torch.Tensor | None = None
        self._verify_captured = False
        # New tokens per request the verify kernel is compiled for (a constexpr: each value is a JIT
        # compile of seconds). Only grows, and a captured graph sets it to K + 1, so the ragged eager steps
        # (fewer drafts near max_tokens) reuse the graphs' compile and mask the rows they lack.
        self._verify_rows = 0
        self._max_extend_len = 0

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_decode():
            self.decode.reserve(fb.batch_size)
        elif fb.forward_mode.is_extend():
            self._max_extend_len = max(fb.extend_seq_lens_cpu, default=0)

    def _store(self, k: torch.Tensor, v: torch.Tensor, layer: Attention, fb: ForwardBatch
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        pool = fb.token_to_kv_pool
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        k3 = k.view(-1, layer.num_kv_heads, layer.head_dim)
        v3 = v.view(-1, layer.num_kv_heads, layer.head_dim)
        store_kv(k_buf, v_buf, fb.out_cache_loc, k3, v3, *pool.layer_scales(layer.layer_id))
        return k3, v3, k_buf, v_buf

    def _verify_scratch(self, num_tokens: int, grow: bool) -> torch.Tensor:
        ws = self._verify_workspace
        if ws is not None and ws.shape[0] >= num_tokens:
            return ws
        ws = verify_attention_workspace(num_tokens, self.num_heads, self.head_dim, self.num_kv_splits, self.device)
        if grow:
            self._verify_workspace = ws
        return ws  # an eager step larger than every graph: its own scratch, the graphs keep theirs

    def extend_reads_kv_from_pool(self, fb: ForwardBatch) -> bool:
        return fb.token_to_kv_pool.is_fp8  # the new tokens as the pool holds them (forward_extend)

    def forward_extend(self, q, k, v, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        if fb.forward_mode.is_target_verify() and 0 < max(self._max_extend_len, self._verify_rows) <= VERIFY_MAX_TOKENS:
            return self._forward_verify(q, k, v, layer, fb)
        pool = fb.token_to_kv_pool
        if k is None:  # FP8: stored by the fused rotary + KV store, and read back below as always
            k_buf, v_buf = pool.get_kv(layer.layer_id)
        else:
            k3, v3, k_buf, v_buf = self._store(k, v, layer, fb)
        k_scale, v_scale = pool.layer_scales(layer.layer_id)
        if pool.is_fp8:  # the new tokens as the pool holds them, as every later read (and torch_native) sees them
            k3 = dequantize_kv(gather_rows(k_buf, fb.out_cache_loc), k_scale, q.dtype)
            v3 = dequantize_kv(gather_rows(v_buf, fb.out_cache_loc), v_scale, q.dtype)
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        o = torch.empty((q3.shape[0], layer.num_heads, layer.head_dim), dtype=q.dtype, device=q.device)
        extend_attention_fwd(q3, k3, v3, o, k_buf, v_buf, self.req_to_token, fb.req_pool_indices, fb.seq_lens,
                             fb.extend_prefix_lens, fb.extend_start_loc, self._max_extend_len, layer.scaling,
                             sliding_window=layer.sliding_window, k_scale=k_scale, v_scale=v_scale)
        return o.view(-1, layer.num_heads * layer.head_dim)

    def _forward_verify(self, q, k, v, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        """Every key, the new tokens' included, is read back from the pool (as the FP8 extend path does)."""
        _, _, k_buf, v_buf = self._store(k, v, layer, fb)
        k_scale, v_scale = fb.token_to_kv_pool.layer_scales(layer.layer_id)
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        o = torch.empty((q3.shape[0], layer.num_heads, layer.head_dim), dtype=q.dtype, device=q.device)
        self._verify_rows = max(self._verify_rows, self._max_extend_len)
        verify_attention_fwd(q3, k_buf, v_buf, o, self.req_to_token, fb.req_pool_indices, fb.seq_lens,
                             fb.extend_prefix_lens, fb.extend_start_loc, self._verify_rows, layer.scaling,
                             num_kv_splits=self.num_kv_splits,
                             workspace=self._verify_scratch(q3.shape[0], grow=not self._verify_captured),
                             sliding_window=layer.sliding_window, k_scale=k_scale, v_scale=v_scale)
        return o.view(-1, layer.num_heads * layer.head_dim)

    def forward_decode(self, q, k, v, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        if k is None:  # stored by the fused rotary + KV store
            k_buf, v_buf = fb.token_to_kv_pool.get_kv(layer.layer_id)
        else:
            _, _, k_buf, v_buf = self._store(k, v, layer, fb)
        k_scale, v_scale = fb.token_to_kv_pool.layer_scales(layer.layer_id)
        return self.decode(q, k_buf, v_buf, layer, fb, k_scale, v_scale, self.fuse_merge)

    # ---- CUDA graphs: the kernels read seq_lens/req_to_token on device, so replay needs no re-plan --------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        self.decode.reserve(max_bs)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor, forward_mode: ForwardMode,
                                                 tokens_per_req: int = 1) -> None:
        self._check_graph_mode(forward_mode)
        self.decode.reserve(bs)
        self._max_extend_len = tokens_per_req  # the grid of a captured TARGET_VERIFY
        if forward_mode.is_target_verify():
            self._verify_scratch(bs * tokens_per_req, grow=not self._verify_captured)
            self._verify_captured = True
            self._verify_rows = max(self._verify_rows, tokens_per_req)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int,
                                                forward_mode: ForwardMode, seq_lens_cpu: list[int] | None = None
                                                ) -> None:
        self._check_graph_mode(forward_mode)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1
