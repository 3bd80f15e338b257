"""DECODE with K/V already in the pool (k = v = None: what Attention.forward_rotary passes after the
fused rotary + KV store kernel) against the backend storing them itself: same outputs, same pool, for
the torch_native and Triton backends on CPU (Triton interpreter), fp32 and FP8 pools; a pure EXTEND the
same where the backend reads the new K/V back from the pool (Triton over FP8).
flashinfer's branch is the same `k is None` test; tests/gpu/test_decode_fusion_gpu.py runs it."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_triton_attn_backend import HKV, HQ, SLOTS, D, _batch, _runner  # noqa: E402

from kernels.rotary import apply_rotary  # noqa: E402
from kernels.rotary_kv_store import rotary_kv_store  # noqa: E402
from runtime.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from runtime.attention.triton_backend import TritonAttnBackend  # noqa: E402
from runtime.layers.rotary import RotaryEmbedding  # noqa: E402
from runtime.mem_cache.kv_pool import TokenToKVPool  # noqa: E402
from runtime.model_config import RopeConfig  # noqa: E402
from runtime.model_executor.forward_batch import ForwardBatch  # noqa: E402
from runtime.model_executor.forward_mode import ForwardMode  # noqa: E402


def _fp8_runner(seed: int):
    runner = _runner(seed)
    runner.token_to_kv_pool = TokenToKVPool(SLOTS, 1, HKV, D, torch.float8_e4m3fn, "cpu", 0.5)
    runner.token_to_kv_pool.k_buffers[0].copy_(torch.randn(SLOTS + 1, HKV, D).clamp(-4, 4))
    runner.token_to_kv_pool.v_buffers[0].copy_(torch.randn(SLOTS + 1, HKV, D).clamp(-4, 4))
    return runner


@pytest.mark.parametrize("cls,fp8", [(TorchNativeAttnBackend, False), (TritonAttnBackend, False),
                                     (TritonAttnBackend, True)])
def test_prestored_decode_equals_backend_store(cls, fp8: bool) -> None:
    """Bit-equal: the unfused side rotates with the rotary kernel too. (torch_native's FP8 store is torch's
    e4m3 cast, which the Triton interpreter's own cast does not match at powers of two on CPU:
    tests/kernels/test_fp8_kv_kernels.py; tests/gpu/test_decode_fusion_gpu.py covers it on the GPU.)"""
    rotary = RotaryEmbedding(D, 128, RopeConfig(theta=10000.0))
    results = []
    for fused in (False, True):
        runner = (_fp8_runner if fp8 else _runner)(seed=3)
        wb = _batch(runner, ForwardMode.DECODE, [1, 17, 33, 5], [0, 16, 32, 4])
        backend = cls(runner.spec)
        fb = ForwardBatch.init_new(wb, runner.req_to_token_pool, runner.token_to_kv_pool, backend, runner.device)
        fb.write_req_to_token()
        backend.init_forward_metadata(fb)
        torch.manual_seed(7)
        qkv = torch.randn(4, (HQ + 2 * HKV) * D)
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        pool = runner.token_to_kv_pool
        if fused:
            k_buf, v_buf = pool.get_kv(0)
            rotary_kv_store(fb.positions, q, k, v, rotary.cos_sin_cache, k_buf, v_buf, fb.out_cache_loc,
                            pool.k_scales[0], pool.v_scales[0])
            out = backend.forward(q, None, None, runner.layer, fb)
        else:
            apply_rotary(fb.positions, q, k, rotary.cos_sin_cache, D)
            out = backend.forward(q, k, v.contiguous(), runner.layer, fb)
        results.append((out, pool.k_buffers[0].float().clone(), pool.v_buffers[0].float().clone()))
    (out_a, k_a, v_a), (out_b, k_b, v_b) = results
    assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)
    assert torch.equal(out_a, out_b)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED])
def test_prestored_kv_only_in_decode(mode: ForwardMode) -> None:
    runner = _runner(seed=1)
    wb = _batch(runner, mode, [12, 9], [5, 8])
    backend = TorchNativeAttnBackend(runner.spec)
    fb = ForwardBatch.init_new(wb, runner.req_to_token_pool, runner.token_to_kv_pool, backend, runner.device)
    with pytest.raises(ValueError, match="only in DECODE, not"):
        backend.forward(torch.randn(8, HQ * D), None, None, runner.layer, fb)


@pytest.mark.parametrize("fp8", [False, True])
def test_prestored_kv_in_extend_where_the_backend_reads_the_pool(fp8: bool) -> None:
    """Triton's extend reads an FP8 pool's new K/V back from the pool, so a pure EXTEND may come with them
    stored (same output and pool as the backend storing them); over a 16-bit pool, and in MIXED, it may not."""
    wb_args = ([12, 9], [5, 8])
    results = []
    for fused in (False, True):
        runner = (_fp8_runner if fp8 else _runner)(seed=3)
        wb = _batch(runner, ForwardMode.EXTEND, *wb_args)
        backend = TritonAttnBackend(runner.spec)
        fb = ForwardBatch.init_new(wb, runner.req_to_token_pool, runner.token_to_kv_pool, backend, runner.device)
        fb.write_req_to_token()
        backend.init_forward_metadata(fb)
        assert backend.stores_first_ok(fb) == fp8
        torch.manual_seed(7)
        q, k, v = torch.randn(8, HQ * D), torch.randn(8, HKV * D), torch.randn(8, HKV * D)
        pool = runner.token_to_kv_pool
        if not fp8:
            with pytest.raises(ValueError, match="only in DECODE, not EXTEND"):
                backend.forward(q, None, None, runner.layer, fb)
            return
        if fused:
            backend._store(k, v, runner.layer, fb)  # what the fused kernel leaves in the pool
            out = backend.forward(q, None, None, runner.layer, fb)
        else:
            out = backend.forward(q, k, v, runner.layer, fb)
        results.append((out, pool.k_buffers[0].float().clone(), pool.v_buffers[0].float().clone()))
    (out_a, k_a, v_a), (out_b, k_b, v_b) = results
    assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b) and torch.equal(out_a, out_b)
    mixed = _batch(runner, ForwardMode.MIXED, *wb_args)
    fb = ForwardBatch.init_new(mixed, runner.req_to_token_pool, runner.token_to_kv_pool, backend, runner.device)
    with pytest.raises(ValueError, match="only in DECODE or EXTEND, not MIXED"):
        backend.forward(q, None, None, runner.layer, fb)
