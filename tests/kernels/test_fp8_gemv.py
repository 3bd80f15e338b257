"""The w8a16 FP8 GEMV (kernels/fp8_gemv.py) in the Triton interpreter on CPU, tiny shapes: both inner
formulations (multiply + sum, tl.dot), split-K, ragged N and K, bias, scale layouts, against the torch
reference. The interpreter loads float8_e4m3fn and widens it exactly, so the fp8 weight is tested as is;
activations are fp32/fp16 here because the interpreter's tl.dot on bf16 is wrong (bf16 runs on the GPU,
tests/gpu/test_fp8_gemv_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemv import (
    GemvConfig,
    fp8_linear_small_m,
    fp8_linear_small_m_ref,
    pick_config,
    use_small_m,
)
from runtime.layers.fp8_linear import fp8_linear, quantize_per_channel

F8 = torch.float8_e4m3fn


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0, bias: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w8, scale = quantize_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w8, scale, b


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # one rounding of the fp32 result to 16 bits, plus fp32 summation-order noise
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


CONFIGS = {
    "gemv": GemvConfig(block_n=8, block_k=32),
    "gemv_split": GemvConfig(block_n=16, block_k=32, split_k=2),
    "dot": GemvConfig(block_n=16, block_k=32, use_dot=True),
    "dot_split": GemvConfig(block_n=16, block_k=16, split_k=4, use_dot=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("m", "n", "k"), [(1, 48, 128), (3, 40, 96), (16, 32, 64), (5, 37, 70)])
def test_kernel_matches_reference(name: str, m: int, n: int, k: int) -> None:
    x, w8, scale, _ = _operands(m, n, k, torch.float32)
    _close(fp8_linear_small_m(x, w8, scale, config=CONFIGS[name]), fp8_linear_small_m_ref(x, w8, scale))


@pytest.mark.parametrize("m", [1, 2, 7, 16])
def test_default_config_fp16_with_bias(m: int) -> None:
    x, w8, scale, b = _operands(m, 64, 96, torch.float16, seed=m, bias=True)
    got = fp8_linear_small_m(x, w8, scale.view(-1), b)
    _close(got, fp8_linear_small_m_ref(x, w8, scale, b))


def test_split_k_with_bias_and_non_contiguous_x() -> None:
    x, w8, scale, b = _operands(4, 24, 64, torch.float32, seed=3, bias=True)
    xt = torch.cat([x, x], dim=1)[:, ::2]  # K-stride 2: the wrapper makes it contiguous
    assert not xt.is_contiguous()
    got = fp8_linear_small_m(xt, w8, scale, b, config=GemvConfig(block_n=8, block_k=16, split_k=2))
    _close(got, fp8_linear_small_m_ref(xt, w8, scale, b))


def test_reference_is_the_dequantized_matmul() -> None:
    x, w8, scale, b = _operands(3, 20, 40, torch.float32, bias=True)
    want = x.double() @ (w8.double() * scale.double()).t() + b.double()
    torch.testing.assert_close(fp8_linear_small_m_ref(x, w8, scale, b).double(), want, rtol=1e-5, atol=1e-5)


def test_per_tensor_scale_and_empty_batch() -> None:
    x, w8, _, _ = _operands(2, 16, 32, torch.float32)
    s = torch.tensor([0.01])
    _close(fp8_linear_small_m(x, w8, s), fp8_linear_small_m_ref(x, w8, s.expand(16)))
    assert fp8_linear_small_m(x[:0], w8, s).shape == (0, 16)


def test_bad_inputs_raise() -> None:
    x, w8, scale, _ = _operands(2, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="do not multiply"):
        fp8_linear_small_m(x[:, :16], w8, scale)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_linear_small_m(x, w8.float(), scale)
    with pytest.raises(ValueError, match="output channels"):
        fp8_linear_small_m(x, w8, scale[:5])
    with pytest.raises(ValueError, match="bias"):
        fp8_linear_small_m(x, w8, scale, torch.zeros(3))


def test_dispatch_keeps_cpu_on_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w8, scale, _ = _operands(2, 16, 32, torch.float32)
    assert not use_small_m(x, w8)  # CPU tensors: the existing path
    monkeypatch.setenv("SHOAL_FP8_GEMV_MAX_M", "0")
    assert not use_small_m(x, w8)
    # fp8_linear on CPU still quantizes activations per token (w8a8), unlike the w8a16 GEMV
    y = fp8_linear(x, w8, scale)
    assert y.shape == (2, 16)
    assert not torch.equal(y, fp8_linear_small_m_ref(x, w8, scale))


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_pick_config_fills_the_sms_on_llama8b_shapes(m: int, n: int, k: int) -> None:
    cfg = pick_config(m, n, k, sm_count=132)
    assert triton_cdiv(n, cfg.block_n) * cfg.split_k >= 2 * 132
    assert k % (cfg.split_k * cfg.block_k) == 0  # the unmasked (vectorised) K loop
    assert cfg.use_dot == (m > 4)
    if not cfg.use_dot:  # the [BLOCK_M, BLOCK_N, BLOCK_K] fp32 register tile stays bounded
        assert pow2(m) * cfg.block_n * cfg.block_k <= 8192


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("m", "n", "k", "dtype"), [(1, 48, 128, torch.float32), (3, 40, 96, torch.float16),
                                                    (5, 37, 70, torch.float32)])
def test_gated_equals_silu_and_mul_then_gemv(name: str, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    """gated=True (the down projection reading the MLP's gate_up output) is the SiLU-and-mul kernel followed
    by the plain GEMV, bit for bit, in every inner formulation; and matches the torch reference."""
    from kernels.activation import silu_and_mul

    gen = torch.Generator().manual_seed(k)
    gate_up = (torch.randn(m, 2 * k, generator=gen) * 2).to(dtype)
    _, w8, scale, _ = _operands(m, n, k, dtype)
    fused = fp8_linear_small_m(gate_up, w8, scale, config=CONFIGS[name], gated=True)
    unfused = fp8_linear_small_m(silu_and_mul(gate_up), w8, scale, config=CONFIGS[name])
    assert torch.equal(fused, unfused)
    _close(fused, fp8_linear_small_m_ref(gate_up, w8, scale, gated=True))


def test_gated_shape_check() -> None:
    x, w8, scale, _ = _operands(2, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="gate and up"):
        fp8_linear_small_m(x, w8, scale, gated=True)


@pytest.mark.parametrize(("m", "config"), [(40, GemvConfig(block_n=16, block_k=32, use_dot=True)),
                                           (70, GemvConfig(block_n=16, block_k=32, split_k=2, use_dot=True)),
                                           (24, GemvConfig(block_n=8, block_k=32))])
def test_rows_beyond_one_tile(m: int, config: GemvConfig) -> None:
    """M above 16 (SHOAL_FP8_GEMV_MAX_M raised) runs rows in tiles on a third grid axis (tl.dot: up to 64 rows
    a tile, so 70 takes two; multiply + sum: 16): every row is computed (before, rows past the first
    16-row tile were left as the output's uninitialised memory)."""
    x, w8, scale, b = _operands(m, 40, 64, torch.float32, seed=m, bias=True)
    _close(fp8_linear_small_m(x, w8, scale, b, config=config), fp8_linear_small_m_ref(x, w8, scale, b))


@pytest.mark.parametrize("m", [1, 4, 5, 32])
def test_down_projection_takes_gated_gemv_only_at_small_m(monkeypatch: pytest.MonkeyPatch, m: int) -> None:
    """Where the GEMV serves, the FP8 down projection applies SiLU-and-mul inside it only up to GATED_M_MAX
    rows (above, each N block would recompute it over all of K); past that the activation runs once first.
    Both ways give the reference's bits (the GEMV's calls are stood in for by its torch reference here)."""
    from types import MethodType, SimpleNamespace

    from kernels import fp8_gemv
    from runtime.layers import fp8_linear as fl

    calls: list[bool] = []

    def spy(x, w8, w_scale, bias=None, config=None, gated=False):
        calls.append(gated)
        return fp8_gemv.fp8_linear_small_m_ref(x, w8, w_scale, bias, gated=gated)

    monkeypatch.setattr(fl, "use_small_m", lambda x2, w8, max_m=None: True)
    monkeypatch.setattr(fl, "fp8_linear_small_m", spy)
    gen = torch.Generator().manual_seed(m)
    w8, scale = fl.quantize_per_channel(torch.randn(24, 32, generator=gen))
    layer = SimpleNamespace(weight=w8, weight_scale=scale, fused_act_quant=True, weight_only=False, act_terms=1,
                            use_scaled_mm=False, reduce_results=False, bias=None)
    layer.forward = MethodType(fl._row_forward, layer)
    layer._reduce = lambda y: y  # one rank: RowParallelLinear._reduce has nothing to sum
    gate_up = torch.randn(m, 64, generator=gen)
    act = torch.nn.SiLU()

    def silu_mul(t: torch.Tensor) -> torch.Tensor:
        gate, up = t.chunk(2, dim=-1)
        return act(gate) * up

    y = fl._row_forward_silu_mul(layer, gate_up, silu_mul)
    assert calls == [m <= fp8_gemv.GATED_M_MAX]
    torch.testing.assert_close(y, fp8_gemv.fp8_linear_small_m_ref(gate_up, w8, scale, gated=True), rtol=1e-6, atol=1e-6)
    assert fp8_gemv.gated_serves(fp8_gemv.GATED_M_MAX) and not fp8_gemv.gated_serves(fp8_gemv.GATED_M_MAX + 1)
    assert not fp8_gemv.gated_serves(0)
