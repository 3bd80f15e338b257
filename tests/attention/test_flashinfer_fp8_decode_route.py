"""The flashinfer backend's routing, on CPU with a stand-in flashinfer module (the real one is GPU-only): over
an FP8 pool its DECODE runs our Triton kernel (interpreter here) with no plan and nothing to do at graph
capture or replay; by default a 16-bit pool's DECODE runs it too (bf16 math); SHOAL_FP8_DECODE=flashinfer
keeps flashinfer's decode wrapper for FP8, and SHOAL_DECODE_KERNEL forces either kernel for every pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from flashinfer_stub import flashinfer_backend_cls

from kernels.decode_attention import decode_attention_ref
from runtime.attention.spec import AttentionSpec
from runtime.model_executor.forward_mode import ForwardMode

HQ, HKV, D = 4, 2, 64


class _Wrapper:
    """Records plans; any run is a failure in these tests (the FP8 DECODE path must not reach it)."""

    def __init__(self, *args, **kwargs) -> None:
        self.plans = 0

    def plan(self, *args, **kwargs) -> None:
        self.plans += 1

    def run(self, *args, **kwargs) -> None:
        raise AssertionError("flashinfer's wrapper ran")


@pytest.fixture
def backend_cls(monkeypatch: pytest.MonkeyPatch):
    return flashinfer_backend_cls(monkeypatch, BatchPrefillWithPagedKVCacheWrapper=_Wrapper,
                                  BatchDecodeWithPagedKVCacheWrapper=_Wrapper,
                                  BatchPrefillWithRaggedKVCacheWrapper=_Wrapper,
                                  merge_state_in_place=lambda *args, **kwargs: None)


def _spec(kv_dtype: torch.dtype | None) -> AttentionSpec:
    req_to_token = torch.arange(3 * 50, dtype=torch.int32).view(3, 50) + 1
    return AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, scaling=D ** -0.5, dtype=torch.float32,
                         device=torch.device("cpu"), req_to_token=req_to_token, max_bs=3, kv_dtype=kv_dtype)


def test_fp8_decode_runs_our_kernel_without_a_plan(backend_cls) -> None:
    spec = _spec(torch.float8_e4m3fn)
    backend = backend_cls(spec)
    assert backend.triton_decode is not None and backend.triton_decode.config.f16_math
    gen = torch.Generator().manual_seed(0)
    k_buf, v_buf = ((torch.randn(3 * 50 + 1, HKV, D, generator=gen) * 2).to(torch.float8_e4m3fn) for _ in range(2))
    pool = SimpleNamespace(get_kv=lambda layer_id: (k_buf, v_buf), layer_scales=lambda layer_id: (0.5, 0.25),
                           is_fp8=True)
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=3, token_to_kv_pool=pool,
                         req_pool_indices=torch.tensor([2, 0, 1]), seq_lens=torch.tensor([7, 50, 1]))
    # Start-up planned the prefill wrappers once each (the ragged prefill loads its modules); DECODE none.
    plans = (backend.prefill_wrapper.plans, backend.ragged.wrapper.plans)
    assert plans == (1, 1)
    backend.init_forward_metadata(fb)
    assert backend.decode_wrapper.plans == 0 and (backend.prefill_wrapper.plans, backend.ragged.wrapper.plans) == plans
    layer = SimpleNamespace(layer_id=0, num_heads=HQ, num_kv_heads=HKV, head_dim=D, scaling=D ** -0.5,
                            sliding_window=0)
    q = torch.randn(3, HQ * D, generator=gen)
    o = backend.forward(q, None, None, layer, fb)  # K/V already stored (the fused rotary + KV store)
    ref = decode_attention_ref(q.view(3, HQ, D), k_buf, v_buf, spec.req_to_token, fb.req_pool_indices,
                               fb.seq_lens, D ** -0.5, k_scale=0.5, v_scale=0.25)
    torch.testing.assert_close(o.view(3, HQ, D), ref, atol=1e-5, rtol=1e-5)
    # CUDA graphs: scratch reserved once, no wrapper per size, nothing to plan at replay.
    backend.init_cuda_graph_state(8)
    ws = backend.triton_decode._workspace
    backend.init_forward_metadata_capture_cuda_graph(4, torch.zeros(4, dtype=torch.long), torch.ones(4), ForwardMode.DECODE)
    backend.init_forward_metadata_replay_cuda_graph(4, torch.zeros(4, dtype=torch.long), torch.ones(4), 4,
                                                    ForwardMode.DECODE, seq_lens_cpu=[1] * 4)
    assert backend._graph_wrappers == {} and backend.triton_decode._workspace is ws and backend.triton_decode.max_bs == 8


def test_default_routes_every_pool_to_triton_decode(backend_cls, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto takes our kernel for 16-bit pools (bf16 math) and FP8 ones; the older FP8 switch still opts out."""
    monkeypatch.delenv("SHOAL_DECODE_KERNEL", raising=False)
    monkeypatch.delenv("SHOAL_FP8_DECODE", raising=False)
    b16 = backend_cls(_spec(None))
    assert b16.triton_decode is not None and not b16.triton_decode.config.f16_math
    assert backend_cls(_spec(torch.float8_e4m3fn)).triton_decode is not None
    monkeypatch.setenv("SHOAL_FP8_DECODE", "flashinfer")
    assert backend_cls(_spec(torch.float8_e4m3fn)).triton_decode is None
    assert backend_cls(_spec(None)).triton_decode is not None


def test_decode_kernel_switch(backend_cls, monkeypatch: pytest.MonkeyPatch) -> None:
    """SHOAL_DECODE_KERNEL=triton sends a 16-bit pool's DECODE to our kernel (bf16 math), equal to the
    reference with no flashinfer plan; =flashinfer keeps flashinfer's for FP8 too; anything else is refused."""
    monkeypatch.setenv("SHOAL_DECODE_KERNEL", "triton")
    spec = _spec(None)
    backend = backend_cls(spec)
    assert backend.triton_decode is not None and not backend.triton_decode.config.f16_math
    gen = torch.Generator().manual_seed(1)
    k_buf, v_buf = (torch.randn(3 * 50 + 1, HKV, D, generator=gen) for _ in range(2))
    pool = SimpleNamespace(get_kv=lambda layer_id: (k_buf, v_buf), layer_scales=lambda layer_id: (1.0, 1.0),
                           is_fp8=False)
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=2, token_to_kv_pool=pool,
                         req_pool_indices=torch.tensor([1, 2]), seq_lens=torch.tensor([33, 3]))
    backend.init_forward_metadata(fb)
    assert backend.decode_wrapper.plans == 0
    layer = SimpleNamespace(layer_id=0, num_heads=HQ, num_kv_heads=HKV, head_dim=D, scaling=D ** -0.5,
                            sliding_window=0)
    q = torch.randn(2, HQ * D, generator=gen)
    o = backend.forward(q, None, None, layer, fb)
    ref = decode_attention_ref(q.view(2, HQ, D), k_buf, v_buf, spec.req_to_token, fb.req_pool_indices,
                               fb.seq_lens, D ** -0.5)
    torch.testing.assert_close(o.view(2, HQ, D), ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("SHOAL_DECODE_KERNEL", "flashinfer")
    assert backend_cls(_spec(torch.float8_e4m3fn)).triton_decode is None
    monkeypatch.setenv("SHOAL_DECODE_KERNEL", "cutlass")
    with pytest.raises(ValueError, match="SHOAL_DECODE_KERNEL"):
        backend_cls(_spec(None))
