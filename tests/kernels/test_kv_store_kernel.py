import pytest
import torch

from kernels.kv_store import store_kv, store_kv_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_scatters_strided_views_to_random_slots(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    t, hq, hkv, d, slots = 7, 4, 2, 24, 40
    # k and v as views of a fused qkv projection: row stride != Hkv * D.
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    loc = (torch.randperm(slots - 1, generator=gen)[:t] + 1).to(torch.int64)
    k_buf, v_buf = torch.randn(slots, hkv, d, generator=gen).to(dtype), torch.randn(slots, hkv, d).to(dtype)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    store_kv(k_buf, v_buf, loc, k, v)
    store_kv_ref(k_ref, v_ref, loc, k, v)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)


def test_store_kv_wide_rows_span_several_programs() -> None:
    # Hkv * D = 1280 > the 1024-element block: one token's row is written by two programs.
    t, hkv, d = 3, 10, 128
    k, v = torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    k_buf, v_buf = torch.zeros(8, hkv, d), torch.zeros(8, hkv, d)
    loc = torch.tensor([5, 1, 6])
    store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
    untouched = torch.tensor([0, 2, 3, 4, 7])
    assert not k_buf[untouched].any() and not v_buf[untouched].any()


def test_store_kv_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="do not match"):
        store_kv(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.tensor([1]), torch.zeros(1, 4, 8),
                 torch.zeros(1, 4, 8))
