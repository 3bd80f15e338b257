import pytest
import torch

from kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref, rmsnorm, rmsnorm_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 576])
def test_rmsnorm_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype)
    out = rmsnorm(x, w, 1e-6)
    torch.testing.assert_close(out, rmsnorm_ref(x, w, 1e-6))
    assert out.dtype == dtype


def test_rmsnorm_ref_matches_definition() -> None:
    x, w = torch.randn(3, 32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    # The reference computes in fp32 (as the kernel does), so compare at fp32 precision.
    torch.testing.assert_close(rmsnorm_ref(x, w, 1e-5), expected, rtol=1e-5, atol=1e-6)


def test_rmsnorm_keeps_leading_dims() -> None:
    x, w = torch.randn(2, 3, 48), torch.randn(48)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rmsnorm_updates_both_in_place(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 576, generator=gen).to(dtype)
    residual = torch.randn(6, 576, generator=gen).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    x_ref, r_ref = x.clone(), residual.clone()
    expected_residual = (x.float() + residual.float()).to(dtype)
    fused_add_rmsnorm(x, residual, w, 1e-6)
    fused_add_rmsnorm_ref(x_ref, r_ref, w, 1e-6)
    # Within one rounding step, not bit-equal: the Triton interpreter truncates fp32 → bf16.
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(x, x_ref)
    torch.testing.assert_close(x, rmsnorm_ref(expected_residual, w, 1e-6))
