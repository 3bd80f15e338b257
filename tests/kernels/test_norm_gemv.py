"""The GEMV's norm prologue (kernels/fp8_gemv.NormInput) in the Triton interpreter on CPU: for 16-bit and
fp8 weights, with and without the residual add, whole and masked K, split-K and a bias, the product and
the new residual equal the norm kernel's output fed to the same GEMV, bit for bit (the interpreter sums a
row in one order whatever the warps; on a GPU 1 / rms may differ in its last bit:
tests/gpu/test_dense_gemv_gpu.py), and the inputs are left as they were. Then the layers' side:
ColumnParallelLinear.forward_normed declines where no GEMV serves, and where one does it equals the norm
followed by the layer, for the 16-bit and the FP8 linear (the model end to end:
tests/model_executor/test_norm_gemv_parity.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemv import GemvConfig, dense_linear_small_m, fp8_linear_small_m
from kernels.norm_input import NormInput
from kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from runtime.distributed import ParallelGroup
from runtime.layers.dense_gemm import DenseGemm
from runtime.layers.fp8_linear import quantize_per_channel
from runtime.layers.linear import ColumnParallelLinear, QKVParallelLinear

EPS = 1e-5
CONFIGS = {
    "default": None,
    "narrow": GemvConfig(block_n=8, block_k=32),
    "split": GemvConfig(block_n=16, block_k=32, split_k=2),
    "peeled": GemvConfig(block_n=8, block_k=32, peel=True),
}


def _operands(n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, k, generator=gen) * 3).to(dtype)
    r = torch.randn(1, k, generator=gen).to(dtype)
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    return x, r, g, w, b


def _unfused(x, r, g, gemv):
    """The norm kernel, then the GEMV on its output: what the prologue must reproduce."""
    if r is None:
        return gemv(rmsnorm(x, g, EPS)), x
    xc, rc = x.clone(), r.clone()
    fused_add_rmsnorm(xc, rc, g, EPS)
    return gemv(xc), rc


def _check(x, r, g, gemv) -> None:
    """gemv(h, norm=None) with the norm prologue against the norm kernel then gemv: the same bits, the new
    residual too, and the inputs left as they were."""
    x0, r0 = x.clone(), None if r is None else r.clone()
    want, want_res = _unfused(x, r, g, gemv)
    res_out = None if r is None else torch.empty_like(r)
    got = gemv(x, NormInput(g, EPS, r, res_out))
    assert torch.equal(got, want)
    if r is not None:
        assert torch.equal(res_out, want_res)
        assert torch.equal(r, r0)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize(("n", "k", "dtype"), [(48, 128, torch.float32), (40, 96, torch.float16),
                                               (37, 256, torch.float16)])
def test_dense_equals_norm_then_gemv(name: str, add: bool, n: int, k: int, dtype: torch.dtype) -> None:
    x, r, g, w, b = _operands(n, k, dtype, seed=n + k)
    cfg = CONFIGS[name]
    _check(x, r if add else None, g, lambda h, norm=None: dense_linear_small_m(h, w, b, config=cfg, norm=norm))


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("name", ["default", "split"])
def test_fp8_equals_norm_then_gemv(add: bool, name: str) -> None:
    x, r, g, w, _ = _operands(64, 256, torch.float16, seed=7)
    w8, scale = quantize_per_channel(w)
    cfg = CONFIGS[name]
    _check(x, r if add else None, g, lambda h, norm=None: fp8_linear_small_m(h, w8, scale, config=cfg, norm=norm))


def test_norm_is_refused_where_the_prologue_cannot_run() -> None:
    x, _, g, w, _ = _operands(16, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="one row"):
        dense_linear_small_m(torch.cat([x, x]), w, norm=NormInput(g, EPS))
    with pytest.raises(ValueError, match="one row"):
        dense_linear_small_m(x, w, config=GemvConfig(block_n=16, block_k=32, use_dot=True), norm=NormInput(g, EPS))
    with pytest.raises(ValueError, match="residual_out"):
        dense_linear_small_m(x, w, norm=NormInput(g, EPS, x.clone()))
    with pytest.raises(ValueError, match="norm weight"):
        dense_linear_small_m(x, w, norm=NormInput(g[:-1], EPS))


def _layer(cls, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    group = ParallelGroup.single()
    layer = (QKVParallelLinear(64, 16, 4, 2, True, group, dtype=dtype) if cls is QKVParallelLinear
             else ColumnParallelLinear(64, 48, False, group, dtype=dtype))
    for p in layer.parameters():
        p.data.copy_(torch.randn_like(p, dtype=torch.float32).mul_(0.1).to(dtype))
    return layer


def test_forward_normed_declines_without_a_gemv() -> None:
    layer = _layer(ColumnParallelLinear, torch.float16)
    x, r, g, _, _ = _operands(48, 64, torch.float16, seed=2)
    assert layer.forward_normed(x, r, g, EPS) is None  # CPU: F.linear serves, the caller runs the norm
    assert layer.forward_normed(torch.cat([x, x]), None, g, EPS) is None


@pytest.mark.parametrize("cls", [ColumnParallelLinear, QKVParallelLinear])
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_forward_normed_equals_norm_then_layer(monkeypatch: pytest.MonkeyPatch, cls, add: bool, fp8: bool) -> None:
    from runtime.layers import fp8_linear

    layer = _layer(cls, torch.float16)
    if fp8:
        w8, scale = quantize_per_channel(layer.weight.data)
        layer.weight = torch.nn.Parameter(w8, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        fp8_linear.use_fp8_forward(layer, torch.float16, weight_only=True)
        # CPU: the GEMV is the interpreter's; let both the layer and the reference take it
        monkeypatch.setattr(fp8_linear, "use_small_m", lambda x2, w8, max_m=None: x2.shape[0] == 1)
    else:
        monkeypatch.setattr(DenseGemm, "serves", lambda self, x, w: x.shape[0] == 1)
    x, r, g, _, _ = _operands(1, 64, torch.float16, seed=3)
    r = r if add else None
    want, want_res = _unfused(x, r, g, layer)
    got, res = layer.forward_normed(x, r, g, EPS)
    assert torch.equal(got, want)
    assert torch.equal(res, want_res)
    if not add:
        assert res is x  # the first layer's residual is its input, as in the unfused path
