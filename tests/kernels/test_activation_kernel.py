import pytest
import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul, silu_and_mul_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [48, 1536])
def test_silu_and_mul_matches_reference(dtype: torch.dtype, inter: int) -> None:
    x = torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = silu_and_mul(x)
    assert out.shape == (5, inter) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_ref(x))


def test_silu_and_mul_is_gate_times_up() -> None:
    gate, up = torch.randn(3, 16), torch.randn(3, 16)
    torch.testing.assert_close(silu_and_mul(torch.cat([gate, up], dim=-1)), F.silu(gate) * up)


def test_silu_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="not even"):
        silu_and_mul(torch.randn(2, 7))
