"""The fused rotary + KV store against the unfused sequence it replaces (in-place rotary, then store_kv):
the same rotated q, the same pool contents bit for bit (bf16/fp32 pools and FP8 pools with a scale), k
and the untouched slots left alone."""

import os

import pytest
import torch

from kernels.kv_store import store_kv
from kernels.rotary import apply_rotary
from kernels.rotary_kv_store import rotary_kv_store, rotary_kv_store_ref


def _cos_sin_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _case(dtype: torch.dtype, kv_dtype: torch.dtype, t: int = 5, hq: int = 4, hkv: int = 2, d: int = 32,
          slots: int = 23):
    gen = torch.Generator().manual_seed(0)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 3).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views, as the model passes them
    positions = torch.tensor([0, 1, 7, 100, 3][:t])
    loc = torch.randperm(slots - 1, generator=gen)[:t] + 1
    k_buf = torch.randn(slots, hkv, d, generator=gen).to(kv_dtype)
    v_buf = torch.randn(slots, hkv, d, generator=gen).to(kv_dtype)
    return qkv, q, k, v, positions, loc, k_buf, v_buf, _cos_sin_cache(128, d)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype,kv_dtype,k_scale,v_scale", [
    (torch.float32, torch.float32, 1.0, 1.0),
    (torch.bfloat16, torch.bfloat16, 1.0, 1.0),
    (torch.float16, torch.float16, 1.0, 1.0),
    (torch.bfloat16, torch.float8_e4m3fn, 1.0, 1.0),
    (torch.bfloat16, torch.float8_e4m3fn, 0.02, 0.5),  # small k scale: many values saturate at +-448
])
def test_fused_equals_unfused_kernels(is_neox, dtype, kv_dtype, k_scale, v_scale) -> None:
    qkv, q, k, v, pos, loc, k_buf, v_buf, cache = _case(dtype, kv_dtype)
    qkv_u = qkv.clone()
    q_u, k_u, v_u = qkv_u.split([q.shape[1], k.shape[1], v.shape[1]], dim=-1)
    kb_u, vb_u = k_buf.clone(), v_buf.clone()
    d = k_buf.shape[-1]
    apply_rotary(pos, q_u, k_u, cache, d, is_neox=is_neox)
    store_kv(kb_u, vb_u, loc, k_u.view(-1, k_buf.shape[1], d), v_u.contiguous().view(-1, v_buf.shape[1], d),
             k_scale, v_scale)
    k_before = k.clone()
    rotary_kv_store(pos, q, k, v, cache, k_buf, v_buf, loc, k_scale, v_scale, is_neox=is_neox)
    assert torch.equal(q, q_u)
    assert torch.equal(k, k_before)  # k is rotated into the pool only
    assert torch.equal(k_buf.view(torch.uint8) if k_buf.element_size() == 1 else k_buf,
                       kb_u.view(torch.uint8) if kb_u.element_size() == 1 else kb_u)
    assert torch.equal(v_buf.view(torch.uint8) if v_buf.element_size() == 1 else v_buf,
                       vb_u.view(torch.uint8) if vb_u.element_size() == 1 else vb_u)


@pytest.mark.parametrize("kv_dtype,scale", [(torch.float32, 1.0), (torch.float8_e4m3fn, 0.25)])
def test_fused_matches_torch_reference(kv_dtype, scale) -> None:
    qkv, q, k, v, pos, loc, k_buf, v_buf, cache = _case(torch.float32, kv_dtype, t=3, hq=8, hkv=1, d=16)
    q_ref, kb_ref, vb_ref = q.clone(), k_buf.clone(), v_buf.clone()
    untouched = torch.ones(k_buf.shape[0], dtype=torch.bool)
    untouched[loc] = False
    rotary_kv_store(pos, q, k, v, cache, k_buf, v_buf, loc, scale, scale)
    rotary_kv_store_ref(pos, q_ref, k, v, cache, kb_ref, vb_ref, loc, scale, scale)
    torch.testing.assert_close(q, q_ref)
    if k_buf.element_size() == 1:
        # The kernel's and torch's fp32 rotations may differ in the last bit and so round to neighbouring
        # e4m3 values (one step = 1/8); the interpreter's own fp32 -> e4m3 cast also rounds values that
        # should round up to a power of two toward zero (-7.78 -> -4: tests/kernels/test_fp8_kv_kernels.py).
        got, want = k_buf.float(), kb_ref.float()
        differ = got != want
        assert differ.float().mean() < 0.05
        assert bool(((got[differ] - want[differ]).abs() <= want[differ].abs() * 0.13).all()
                    or os.environ.get("TRITON_INTERPRET") == "1")
    else:
        torch.testing.assert_close(k_buf, kb_ref)
    torch.testing.assert_close(v_buf.float(), vb_ref.float())
    assert torch.equal(k_buf[untouched].float(), kb_ref[untouched].float())


def test_fused_rejects_partial_rotary_and_mismatched_shapes() -> None:
    _, q, k, v, pos, loc, k_buf, v_buf, cache = _case(torch.float32, torch.float32)
    with pytest.raises(ValueError, match="whole heads"):
        rotary_kv_store(pos, q, k, v, cache[:, :16], k_buf, v_buf, loc)
    with pytest.raises(ValueError, match="do not match"):
        rotary_kv_store(pos, q, k, v, cache, k_buf, v_buf, loc[:-1])


def test_fused_no_tokens_is_a_no_op() -> None:
    _, q, k, v, pos, loc, k_buf, v_buf, cache = _case(torch.float32, torch.float32)
    before = k_buf.clone()
    rotary_kv_store(pos[:0], q[:0], k[:0], v[:0], cache, k_buf, v_buf, loc[:0])
    assert torch.equal(k_buf, before)
