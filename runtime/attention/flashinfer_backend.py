"""FlashInferAttnBackend: flashinfer's paged prefill/decode wrappers over our token-level KV pool.

Each KV slot is one page (page size 1): the [slots, Hkv, D] buffers are viewed as [slots, 1, Hkv, D]
NHD pages, and a request's page list is its req_to_token row, copied into a flat kv_indices array by a
small Triton kernel. Wrappers are planned once per batch (init_forward_metadata), never per layer.
An FP8 pool (spec.kv_dtype float8_e4m3fn) is planned with that kv_data_type and run with the pool's
static per-layer k_scale/v_scale floats, which flashinfer applies as it reads. DECODE batches, over FP8 and
16-bit pools alike, run our Triton split-KV kernel instead (runtime/attention/triton_decode.py says why:
~30% faster reads of an FP8 pool, 7-9% of a bf16 one), which needs no plan: a captured graph replays with
nothing to do on the host. decode_kernel() says which kernel runs DECODE for each pool and how to switch it.
flashinfer is imported lazily here only: CPU installs do not have it."""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

from kernels.decode_fusion import decode_fusion_enabled
from kernels.kv_store import store_kv
from runtime.attention.base import AttentionBackend
from runtime.attention.ragged_prefill import (
    PrefixSpan,
    RaggedPrefill,
    prefix_span,
    ragged_prefill_choice,
    serves,
)
from runtime.attention.spec import AttentionSpec
from runtime.attention.triton_decode import DecodeKernelConfig, TritonDecode

if TYPE_CHECKING:
    from runtime.layers.attention import Attention
    from runtime.model_executor.forward_batch import ForwardBatch
    from runtime.model_executor.forward_mode import ForwardMode

WORKSPACE_BYTES = 256 * 1024 * 1024
# fa2 serves both the prefill and the tensor-core decode wrapper from one JIT module family, which
# halves the first-use compile time; fa3 would only pay off for long prefills.
FLASHINFER_KERNEL_BACKEND = "fa2"


def decode_kernel(kv_fp8: bool) -> str:
    """The kernel for this backend's DECODE batches: "triton" (our split-KV kernel) or "flashinfer".
    SHOAL_DECODE_KERNEL=auto (default) takes ours for every pool (SHOAL_FP8_DECODE=flashinfer, the older
    switch, keeps flashinfer's for FP8); triton or flashinfer forces one. Ours won in the model, not only in
    the kernel sweep, by ~3% (one H100): the static-vs-continuous workload took 7.10 s against 7.31 s in
    consecutive runs (svc_step_times_decode_kernel_*.json), 462/256 x 500 ran its DECODE batches in 7.03 s
    against flashinfer's 7.22 s of earlier sessions (its same-call run read 10.21 s, an outlier), batch 1
    tied at 5.58 ms."""
    choice = os.environ.get("SHOAL_DECODE_KERNEL", "auto")
    if choice not in ("auto", "triton", "flashinfer"):
        raise ValueError(f"SHOAL_DECODE_KERNEL={choice!r}: expected auto, triton or flashinfer")
    if choice != "auto":
        return choice
    return "flashinfer" if kv_fp8 and os.environ.get("SHOAL_FP8_DECODE", "triton") == "flashinfer" else "triton"


@triton.jit
def _build_kv_indices_kernel(Req_To_Token, Req_Pool_Indices, Seq_Lens, Kv_Indptr, Kv_Indices, stride_req,
                             BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(Req_Pool_Indices + b).to(tl.int64)
    n = tl.load(Seq_Lens + b).to(tl.int32)
    out = tl.load(Kv_Indptr + b).to(tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        slots = tl.load(Req_To_Token + row * stride_req + offs, mask=mask)
        tl.store(Kv_Indices + out + offs, slots, mask=mask)


def build_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> None:
    """kv_indices[kv_indptr[b] : kv_indptr[b] + seq_lens[b]] = req_to_token[req_pool_indices[b], :seq_lens[b]],
    on device with no host sync (so it can run inside a captured graph or before a replay)."""
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    _build_kv_indices_kernel[(bs,)](req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices,
                                    req_to_token.stride(0), BLOCK=512)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where its data is not 16-byte aligned. Triton compiles a kernel once per pointer
    alignment, so a slice starting at an odd request (the requests with a prefix when one is not first)
    would JIT-compile a second variant of the kernel _compile_kv_indices compiled at start-up."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _indptr(lens: list[int]) -> torch.Tensor:
    return _pinned(torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32))


def _pinned(t: torch.Tensor) -> torch.Tensor:
    # Pinned: flashinfer's plan copies it to the device, and a copy from pageable memory waits for the
    # stream to drain — which would stall overlap scheduling behind the batch still running. (CPU tests run
    # the planning with a stand-in flashinfer and no device to pin for.)
    return t.pin_memory() if torch.cuda.is_available() else t


# Head sizes flashinfer's prefill/decode kernels are built for (its own dispatch refuses the rest at the
# first batch, deep in a kernel launch, e.g. "Invalid configuration : NUM_MMA_D_QK=1").
FLASHINFER_HEAD_DIMS = (64, 128, 256)


class FlashInferAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, spec: AttentionSpec):
        from runtime.errors import ModelConfigError

        if spec.has_sliding_window:
            raise ModelConfigError("this model uses sliding-window attention, which the flashinfer backend does "
                                   "not plan yet; use --attention-backend triton (what auto picks for it)")
        if spec.head_dim not in FLASHINFER_HEAD_DIMS:
            raise ModelConfigError(f"head_dim {spec.head_dim} has no flashinfer kernels (it has "
                                   f"{', '.join(map(str, FLASHINFER_HEAD_DIMS))}); use --attention-backend triton "
                                   "(what auto picks for it)")
        import flashinfer

        self._fi = flashinfer
        self.device: torch.device = spec.device
        self.req_to_token: torch.Tensor = spec.req_to_token
        self.max_context_len = self.req_to_token.shape[1]
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim, self.sm_scale = spec.head_dim, spec.scaling
        self.dtype: torch.dtype = spec.dtype
        self.kv_dtype: torch.dtype = spec.kv_dtype or spec.dtype
        # Tensor-core decode reads each KV row once per query-head group; it wins as soon as heads share KV.
        self.use_tensor_cores = self.num_heads // self.num_kv_heads > 1
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=FLASHINFER_KERNEL_BACKEND)
        self.decode_wrapper = self._decode_wrapper()
        choice = ragged_prefill_choice()
        self.ragged = None if choice == "0" else RaggedPrefill(
            flashinfer, self.workspace, self.prefill_wrapper, choice, self.num_heads, self.num_kv_heads,
            self.head_dim, self.sm_scale, self.dtype, self.kv_dtype, self.device)
        self._ragged_batch = False
        if self.ragged is not None:
            self.ragged.load_modules(_indptr([1]), torch.ones(1, dtype=torch.int32, device=self.device))
        self._compile_kv_indices()
        self._wrapper: Any = None
        self._graph_wrappers: dict[int, Any] = {}
        # Which kernel runs DECODE (None: flashinfer's decode wrapper), read once here so captured graphs
        # never mix the two.
        kv_fp8 = self.kv_dtype.itemsize == 1
        use_triton = decode_kernel(kv_fp8) == "triton"
        self.triton_decode = TritonDecode(spec, DecodeKernelConfig.for_kv(kv_fp8)) if use_triton else None
        self.fuse_merge = decode_fusion_enabled()

    def _decode_wrapper(self, **graph_buffers: torch.Tensor) -> Any:
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=bool(graph_buffers), use_tensor_cores=self.use_tensor_cores,
            backend=FLASHINFER_KERNEL_BACKEND, **graph_buffers)

    def _compile_kv_indices(self) -> None:
        """Builds one row's KV indices with the argument types every batch uses. DECODE (Triton's kernel or
        the graphs) never builds them, so the first batch that did (a chunked prefill's continuation) JIT-
        compiled the kernel inside every timed 1000 x 1000, svc and 462/256 run on H100s and H200s."""
        build_kv_indices(self.req_to_token, torch.zeros(1, dtype=torch.int64, device=self.device),
                         torch.ones(1, dtype=torch.int64, device=self.device), _indptr([1]).to(self.device),
                         torch.empty(1, dtype=torch.int32, device=self.device))

    # ---- per batch ------------------------------------------------------------------------------------
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        mode = fb.forward_mode
        self._ragged_batch = False
        if mode.is_idle() or fb.batch_size == 0:
            self._wrapper = None
            return
        if self.ragged is not None and serves(fb):
            self._plan_ragged(fb)
            return
        if mode.is_decode() and self.triton_decode is not None:
            self.triton_decode.reserve(fb.batch_size)
            self._wrapper = None
            return
        kv_indptr_cpu = _indptr(fb.seq_lens_cpu)
        kv_indptr = kv_indptr_cpu.to(self.device, non_blocking=True)
        kv_indices = torch.empty(fb.seq_lens_sum, dtype=torch.int32, device=self.device)
        build_kv_indices(self.req_to_token, fb.req_pool_indices, fb.seq_lens, kv_indptr, kv_indices)
        last_page_len = _pinned(torch.ones(fb.batch_size, dtype=torch.int32))
        if mode.is_decode():
            self._plan_decode(self.decode_wrapper, kv_indptr_cpu, kv_indices, last_page_len)
            self._wrapper = self.decode_wrapper
            return
        # Causal masks in flashinfer align the new tokens with the end of each request's KV.
        self.prefill_wrapper.plan(
            _indptr(fb.extend_seq_lens_cpu), kv_indptr_cpu, kv_indices, last_page_len,
            self.num_heads, self.num_kv_heads, self.head_dim, 1, causal=True, sm_scale=self.sm_scale,
            q_data_type=self.dtype, kv_data_type=self.kv_dtype)
        self._wrapper = self.prefill_wrapper

    def _plan_ragged(self, fb: ForwardBatch) -> None:
        span = None
        requests = prefix_span(fb.extend_prefix_lens_cpu)
        if requests is not None:
            first, last = requests
            kv_indptr = _indptr(fb.extend_prefix_lens_cpu[first:last])
            kv_indices = torch.empty(int(kv_indptr[-1]), dtype=torch.int32, device=self.device)
            build_kv_indices(self.req_to_token, _aligned(fb.req_pool_indices[first:last]),
                             _aligned(fb.extend_prefix_lens[first:last]), kv_indptr.to(self.device, non_blocking=True),
                             kv_indices)
            span = PrefixSpan(requests, _indptr(fb.extend_seq_lens_cpu[first:last]), kv_indptr, kv_indices,
                              _pinned(torch.ones(last - first, dtype=torch.int32)))
        self.ragged.plan(fb, _indptr(fb.extend_seq_lens_cpu), span)
        self._ragged_batch = True
        self._wrapper = None

    def _plan_decode(self, wrapper: Any, kv_indptr_cpu: torch.Tensor, kv_indices: torch.Tensor,
                     last_page_len: torch.Tensor) -> None:
        wrapper.plan(kv_indptr_cpu, kv_indices, last_page_len, self.num_heads, self.num_kv_heads,
                     self.head_dim, 1, pos_encoding_mode="NONE", sm_scale=self.sm_scale,
                     q_data_type=self.dtype, kv_data_type=self.kv_dtype)

    @staticmethod
    def _store(k: torch.Tensor | None, v: torch.Tensor | None, layer: Attention, fb: ForwardBatch
               ) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """The layer's KV buffers and scales, with the new K/V stored first (None: stored by the fused rotary
        + KV store)."""
        pool = fb.token_to_kv_pool
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        k_scale, v_scale = pool.layer_scales(layer.layer_id)
        if k is not None:
            store_kv(k_buf, v_buf, fb.out_cache_loc, k.view(-1, layer.num_kv_heads, layer.head_dim),
                     v.view(-1, layer.num_kv_heads, layer.head_dim), k_scale, v_scale)
        return k_buf, v_buf, k_scale, v_scale

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
             fb: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf, k_scale, v_scale = self._store(k, v, layer, fb)
        q3 = q.reshape(-1, layer.num_heads, layer.head_dim)
        o = torch.empty_like(q3, memory_format=torch.contiguous_format)
        scales = {"k_scale": k_scale, "v_scale": v_scale} if fb.token_to_kv_pool.is_fp8 else {}
        self._wrapper.run(q3, (k_buf.unsqueeze(1), v_buf.unsqueeze(1)), out=o, **scales)
        return o.view(-1, layer.num_heads * layer.head_dim)

    def extend_reads_kv_from_pool(self, fb: ForwardBatch) -> bool:
        # The paged prefill reads every key from the pool; the ragged one takes the new tokens' K/V as given.
        return self.ragged is None or not serves(fb)

    def forward_extend(self, q, k, v, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        if not self._ragged_batch:
            return self._run(q, k, v, layer, fb)
        k_buf, v_buf, k_scale, v_scale = self._store(k, v, layer, fb)
        scales = {"k_scale": k_scale, "v_scale": v_scale} if fb.token_to_kv_pool.is_fp8 else {}
        d = layer.head_dim
        o = self.ragged.run(q.reshape(-1, layer.num_heads, d), k.view(-1, layer.num_kv_heads, d),
                            v.view(-1, layer.num_kv_heads, d), k_buf, v_buf, scales)
        return o.view(-1, layer.num_heads * d)

    def forward_decode(self, q, k, v, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        if self.triton_decode is None:
            return self._run(q, k, v, layer, fb)
        k_buf, v_buf, k_scale, v_scale = self._store(k, v, layer, fb)
        return self.triton_decode(q, k_buf, v_buf, layer, fb, k_scale, v_scale, self.fuse_merge)

    # ---- CUDA graphs ----------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        if self.triton_decode is not None:
            self.triton_decode.reserve(max_bs)
            return
        self._graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        # What plan() reads on the host: it calls last_page_len.to("cpu"), and from a device tensor that
        # copy waits for the stream to drain, i.e. for the batch in flight (it defeated overlap scheduling
        # on every replayed decode step: py-spy showed the scheduler thread blocked there 38% of the time).
        self._graph_last_page_len_host = torch.ones(max_bs, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        # Requests sharing a cached prefix share slots, so the pool size does not bound the index count.
        self._graph_kv_indices = torch.zeros(max_bs * self.max_context_len, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor, forward_mode: ForwardMode,
                                                 tokens_per_req: int = 1) -> None:
        self._check_graph_mode(forward_mode)
        if self.triton_decode is not None:  # reads seq_lens/req_to_token on device: nothing to plan
            self.triton_decode.reserve(bs)
            return
        wrapper = self._decode_wrapper(paged_kv_indptr_buffer=self._graph_kv_indptr[:bs + 1],
                                       paged_kv_indices_buffer=self._graph_kv_indices,
                                       paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs])
        self._graph_wrappers[bs] = wrapper
        self._plan_graph(wrapper, bs, req_pool_indices, seq_lens, seq_lens.tolist())

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int,
                                                forward_mode: ForwardMode, seq_lens_cpu: list[int] | None = None
                                                ) -> None:
        self._check_graph_mode(forward_mode)
        if self.triton_decode is not None:
            return
        if seq_lens_cpu is None:
            seq_lens_cpu = seq_lens.tolist()
        self._plan_graph(self._graph_wrappers[bs], bs, req_pool_indices, seq_lens, seq_lens_cpu)

    def _plan_graph(self, wrapper: Any, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    seq_lens_cpu: list[int]) -> None:
        kv_indptr_cpu = _indptr(seq_lens_cpu)
        kv_indptr = self._graph_kv_indptr[:bs + 1]
        kv_indptr.copy_(kv_indptr_cpu, non_blocking=True)
        n = int(kv_indptr_cpu[-1])
        build_kv_indices(self.req_to_token, req_pool_indices, seq_lens, kv_indptr, self._graph_kv_indices)
        # plan copies indptr/indices into the wrapper's own (these same) buffers and schedules on the host.
        self._plan_decode(wrapper, kv_indptr_cpu, self._graph_kv_indices[:n], self._graph_last_page_len_host[:bs])
        self._wrapper = wrapper

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1
