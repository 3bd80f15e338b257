"""The 16-bit-weight GEMV (kernels/fp8_gemv.dense_linear_small_m) in the Triton interpreter on CPU: every
inner formulation against the fp32 torch product, bias, the gated form bit-equal to SiLU-and-mul then the
GEMV, the config for 2-byte weights on Llama-8B shapes, bad inputs; and DenseGemm (the layers' dispatch)
keeping CPU tensors on F.linear, bit for bit (bf16 runs on the GPU: tests/gpu/test_dense_gemv_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.fp8_gemv import GemvConfig, dense_linear_small_m, pick_config
from runtime.layers.dense_gemm import DenseGemm

CONFIGS = {
    "default": None,
    "gemv": GemvConfig(block_n=8, block_k=32),
    "gemv_split": GemvConfig(block_n=16, block_k=32, split_k=2),
    "dot": GemvConfig(block_n=16, block_k=32, use_dot=True),
}


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    return x, w, b


def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ w.float().t()
    return (y if b is None else y + b.float()).to(x.dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-5 if want.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("m", "n", "k", "dtype"), [(1, 48, 128, torch.float32), (1, 40, 96, torch.float16),
                                                    (3, 37, 70, torch.float32), (1, 24, 1000, torch.float16)])
def test_matches_the_fp32_product(name: str, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    if dtype == torch.float16 and CONFIGS[name] is not None and CONFIGS[name].use_dot:
        pytest.skip("the interpreter's tl.dot is checked in fp32 (the fp8 tests' rule)")
    x, w, b = _operands(m, n, k, dtype, seed=n)
    _close(dense_linear_small_m(x, w, config=CONFIGS[name]), _ref(x, w))
    _close(dense_linear_small_m(x, w, b, config=CONFIGS[name]), _ref(x, w, b))


@pytest.mark.parametrize(("m", "dtype"), [(1, torch.float32), (1, torch.float16), (2, torch.float32)])
def test_gated_equals_silu_and_mul_then_gemv(m: int, dtype: torch.dtype) -> None:
    from kernels.activation import silu_and_mul

    gen = torch.Generator().manual_seed(m)
    gate_up = (torch.randn(m, 2 * 64, generator=gen) * 2).to(dtype)
    _, w, _ = _operands(m, 40, 64, dtype)
    fused = dense_linear_small_m(gate_up, w, gated=True)
    assert torch.equal(fused, dense_linear_small_m(silu_and_mul(gate_up), w))
    _close(fused, _ref(silu_and_mul(gate_up), w))


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                                      (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)])
def test_two_byte_weights_take_the_swept_tile(n: int, k: int) -> None:
    """The H100 sweep's pick for M = 1 on every Llama-8B shape (TP=2 halves too): 8 rows x 1024, no split."""
    cfg = pick_config(1, n, k, sm_count=132, weight_bytes=2)
    assert (cfg.block_n, cfg.block_k, cfg.split_k, cfg.use_dot) == (8, 1024, 1, False)


def test_bad_inputs_raise() -> None:
    x, w, _ = _operands(2, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="do not multiply"):
        dense_linear_small_m(x[:, :16], w)
    with pytest.raises(ValueError, match="bias"):
        dense_linear_small_m(x, w, torch.zeros(3))
    with pytest.raises(TypeError, match="scales"):
        dense_linear_small_m(x, w.to(torch.float8_e4m3fn))
    assert dense_linear_small_m(x[:0], w).shape == (0, 16)


def test_dispatch_keeps_cpu_on_f_linear() -> None:
    x, w, b = _operands(1, 16, 32, torch.bfloat16)
    gemm = DenseGemm(max_m=1)
    assert torch.equal(gemm(x, w, b), F.linear(x, w, b))
    assert gemm.silu_mul(torch.cat([x, x], dim=1), w) is None  # the caller runs SiLU-and-mul, then itself
    assert DenseGemm(max_m=0)(x, w).shape == (1, 16)


def test_env_bounds_the_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_DENSE_GEMV_MAX_M", "0")
    assert DenseGemm.from_env().max_m == 0
    monkeypatch.delenv("SHOAL_DENSE_GEMV_MAX_M")
    assert DenseGemm.from_env().max_m == 1


def test_row_parallel_silu_mul_is_the_two_steps_on_cpu() -> None:
    from runtime.distributed import ParallelGroup
    from runtime.layers.activation import SiluAndMul
    from runtime.layers.linear import RowParallelLinear

    layer = RowParallelLinear(64, 24, bias=True, group=ParallelGroup.single(), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    layer.weight.data.copy_(torch.randn(24, 64, generator=gen))
    layer.bias.data.copy_(torch.randn(24, generator=gen))
    gate_up = torch.randn(3, 128, generator=gen)
    act = SiluAndMul()
    assert torch.equal(layer.forward_silu_mul(gate_up, act), layer(act(gate_up)))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(("n", "k", "block_n"), [(48, 128, 8), (37, 96, 8), (40, 32, 8)])
def test_peeled_first_tile_is_bit_equal(gated: bool, n: int, k: int, block_n: int) -> None:
    """The PDL path loads the first weight tile ahead of the loop (kernels/pdl.py); the sum order and so the
    bits stay those of the plain loop, ragged N and a single-tile K included."""
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, 2 * k if gated else k, generator=gen).to(torch.float16)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.float16)
    b = torch.randn(n, generator=gen).to(torch.float16)
    plain = GemvConfig(block_n=block_n, block_k=32, peel=False)
    peeled = GemvConfig(block_n=block_n, block_k=32, peel=True)
    want = dense_linear_small_m(x, w, b, config=plain, gated=gated)
    assert torch.equal(dense_linear_small_m(x, w, b, config=peeled, gated=gated), want)
    _close(want, _ref(torch.nn.functional.silu(x[:, :k].float()).mul(x[:, k:].float()).to(x.dtype)
                      if gated else x, w, b))


def test_pdl_is_off_on_cpu_and_by_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.pdl import launch_options, pdl_enabled

    assert not pdl_enabled(torch.zeros(1))
    assert launch_options(False) == {} and launch_options(True) == {"launch_pdl": True}
    monkeypatch.setenv("SHOAL_PDL", "0")
    assert not pdl_enabled(torch.zeros(1))
