"""kernels/decode_gemm.py in the Triton interpreter (fp32 and fp16: its bf16 dot is wrong there): every tile
form (plain, swap-AB), split-K, ragged M/N/K and a bias against the fp32 torch reference, and its errors."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_gemm import GemmConfig, decode_gemm, decode_gemm_ref, pick_gemm_config


@pytest.mark.parametrize(("m", "n", "k"), [(5, 40, 48), (32, 64, 64), (33, 70, 96)])
@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_gemm_matches_reference(m: int, n: int, k: int, swap_ab: bool, split_k: int, dtype) -> None:
    torch.manual_seed(m * n + k)
    x, w, b = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    cfg = GemmConfig(block_m=16, block_n=32, block_k=16, split_k=split_k, swap_ab=swap_ab)
    y = decode_gemm(x, w, b, config=cfg)
    assert y.dtype == dtype and y.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), decode_gemm_ref(x, w, b).float(), atol=tol * k ** 0.5, rtol=tol)


def test_decode_gemm_default_pick_and_empty_batch() -> None:
    x, w = torch.randn(3, 32), torch.randn(24, 32)
    assert pick_gemm_config(3, 24, 32).swap_ab and not pick_gemm_config(256, 4096, 4096).swap_ab
    torch.testing.assert_close(decode_gemm(x, w), decode_gemm_ref(x, w), atol=1e-4, rtol=1e-4)
    assert decode_gemm(x[:0], w).shape == (0, 24)


def test_decode_gemm_errors() -> None:
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="do not multiply"):
        decode_gemm(x, torch.randn(8, 12))
    with pytest.raises(ValueError, match="bias"):
        decode_gemm(x, w, torch.randn(5))
    with pytest.raises(TypeError, match="8-bit"):
        decode_gemm(x, w.to(torch.float8_e4m3fn))
