"""The w8a16 FP8 GEMV (kernels/fp8_gemv.py) on the GPU: bf16 activations on Llama-8B and ragged shapes,
every M in 1..16, each inner formulation and split-K, bit-close to the fp32 torch reference (at most one
bf16 rounding flip); replayed from a captured CUDA graph; fp8_linear's dispatch (M <= 2 → GEMV, else
torch._scaled_mm); and the w8a16 error against the unquantized weights no larger than the w8a8 path's."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemv import GemvConfig, fp8_linear_small_m, fp8_linear_small_m_ref, pick_config, small_m_max
from runtime.layers.fp8_linear import (
    fp8_linear,
    quantize_per_channel,
    quantize_per_token,
    scaled_mm_supported,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

BF16 = torch.bfloat16
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
RAGGED = [(1000, 1000), (4104, 4112), (96, 14336), (40, 72)]
CONFIGS = {
    "gemv_n8": GemvConfig(block_n=8, block_k=512),
    "gemv_n16_split2": GemvConfig(block_n=16, block_k=256, split_k=2),
    "dot_n16": GemvConfig(block_n=16, block_k=256, use_dot=True, num_stages=4),
    "dot_n32_split4": GemvConfig(block_n=32, block_k=128, split_k=4, use_dot=True, num_stages=4),
}


def _operands(m: int, n: int, k: int, dtype: torch.dtype = BF16, seed: int = 0, bias: bool = False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    w8, scale = quantize_per_channel(w)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype) if bias else None
    return x, w, w8, scale, b


def _bit_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same fp32 sum up to summation order, rounded once: equal, or one ulp apart where the fp32 values
    straddle a rounding boundary (rare)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    ulp = 2.0 ** -7 if want.dtype == BF16 else 2.0 ** -10
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=1e-5 * float(want.abs().max()))
    assert (got != want).float().mean() < 0.02


@pytest.mark.parametrize(("n", "k"), SHAPES_8B + RAGGED)
def test_default_config_every_m(n: int, k: int) -> None:
    x, _, w8, scale, _ = _operands(16, n, k)
    for m in range(1, 17):
        _bit_close(fp8_linear_small_m(x[:m], w8, scale), fp8_linear_small_m_ref(x[:m], w8, scale))


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (1000, 1000), (96, 14336)])
@pytest.mark.parametrize("m", [1, 3, 8, 16, 33])
def test_configs_with_bias(name: str, n: int, k: int, m: int) -> None:
    x, _, w8, scale, b = _operands(m, n, k, seed=m, bias=True)
    _bit_close(fp8_linear_small_m(x, w8, scale, b, config=CONFIGS[name]), fp8_linear_small_m_ref(x, w8, scale, b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_activation_dtypes(dtype: torch.dtype) -> None:
    for m in (1, 5, 16, 40):  # 40: three row tiles (the GEMV bound raised past 16)
        x, _, w8, scale, _ = _operands(m, 2048, 1024, dtype=dtype)
        got, want = fp8_linear_small_m(x, w8, scale), fp8_linear_small_m_ref(x, w8, scale)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        else:
            _bit_close(got, want)


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("split", [False, True])
def test_cuda_graph_replay(m: int, split: bool) -> None:
    n, k = 6144, 4096
    x, _, w8, scale, b = _operands(m, n, k, seed=7, bias=True)
    cfg = GemvConfig(block_n=16, block_k=256, split_k=4, use_dot=m > 4) if split else pick_config(m, n, k)
    static_x = x.clone()
    fp8_linear_small_m(static_x, w8, scale, b, config=cfg)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fp8_linear_small_m(static_x, w8, scale, b, config=cfg)
    for seed in (1, 2, 3):
        new_x = _operands(m, n, k, seed=100 + seed)[0]
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        _bit_close(static_y, fp8_linear_small_m_ref(new_x, w8, scale, b))


def test_fp8_linear_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """M up to the bound (small_m_max(), 2 by default) takes the GEMV (w8a16); one row more, 17 rows and a
    disabled threshold take the per-token quantize + torch._scaled_mm path; 3-D inputs keep their leading
    shape."""
    if not scaled_mm_supported(torch.device("cuda"), BF16):
        pytest.skip("torch._scaled_mm with row-wise scales needs sm89+")
    x, _, w8, scale, b = _operands(17, 4096, 4096, bias=True)

    def w8a8(xm: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_per_token(xm)
        return torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=BF16) + b

    limit = small_m_max()
    for m in (1, limit):
        assert torch.equal(fp8_linear(x[:m], w8, scale, b), fp8_linear_small_m(x[:m], w8, scale, b))
    assert torch.equal(fp8_linear(x[: limit + 1], w8, scale, b), w8a8(x[: limit + 1]))
    assert torch.equal(fp8_linear(x, w8, scale, b), w8a8(x))
    monkeypatch.setenv("SHOAL_FP8_GEMV_MAX_M", "0")
    assert torch.equal(fp8_linear(x[:limit], w8, scale, b), w8a8(x[:limit]))
    monkeypatch.setenv("SHOAL_FP8_GEMV_MAX_M", "16")
    y3 = fp8_linear(x[:8].view(2, 4, 4096), w8, scale, b)
    assert y3.shape == (2, 4, 4096)
    assert torch.equal(y3.view(8, 4096), fp8_linear_small_m(x[:8], w8, scale, b))


def test_w8a16_is_closer_to_the_bf16_weights_than_w8a8(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, w8, scale, _ = _operands(8, 4096, 4096, seed=11)
    exact = x.float() @ w.t()
    err_gemv = (fp8_linear_small_m(x, w8, scale).float() - exact).abs().mean()
    monkeypatch.setenv("SHOAL_FP8_GEMV_MAX_M", "0")
    err_w8a8 = (fp8_linear(x, w8, scale).float() - exact).abs().mean()
    assert err_gemv < err_w8a8
