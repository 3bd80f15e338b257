import pytest
import torch

from kernels.rotary import apply_rotary, apply_rotary_ref


def _cos_sin_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_reference_on_fused_qkv_views(is_neox: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    t, hq, hkv, d = 6, 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d]  # strided 2-D views, rotated in place
    positions = torch.tensor([0, 1, 7, 100, 3, 3])
    cache = _cos_sin_cache(128, d)
    q_ref, k_ref = q.clone(), k.clone()
    v_before = qkv[:, (hq + hkv) * d:].clone()
    apply_rotary(positions, q, k, cache, d, is_neox=is_neox)
    apply_rotary_ref(positions, q_ref, k_ref, cache, d, is_neox=is_neox)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)


def test_rotary_neox_is_hf_rotate_half() -> None:
    t, h, d = 5, 3, 16
    q, k = torch.randn(t, h, d), torch.randn(t, 1, d)
    positions = torch.tensor([4, 0, 9, 2, 2])
    cache = _cos_sin_cache(16, d)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    expected_q, expected_k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    apply_rotary(positions, q, k, cache, d)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)


def test_rotary_partial_rotary_dim_leaves_tail_alone() -> None:
    t, h, d, rot = 4, 2, 32, 16
    q, k = torch.randn(t, h, d), torch.randn(t, h, d)
    q_tail = q[..., rot:].clone()
    q_ref, k_ref = q.clone(), k.clone()
    positions = torch.tensor([1, 2, 3, 50])
    cache = _cos_sin_cache(64, rot)
    apply_rotary(positions, q, k, cache, d)
    apply_rotary_ref(positions, q_ref, k_ref, cache, d)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    assert torch.equal(q[..., rot:], q_tail)
    assert not torch.allclose(q[..., :rot], q_tail[..., :rot])
