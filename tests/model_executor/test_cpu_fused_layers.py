"""The fused bf16 CPU kernels against the layers' own eager forward (computed in fp32 as the reference),
with the in-place contract of the CUDA kernels, and a bf16 model whose layers use them."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_fused_ops
from runtime.layers.activation import SiluAndMul
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import RotaryEmbedding
from runtime.model_config import RopeConfig
from runtime.model_executor.cpu_fused_layers import fuse_cpu_layers

pytestmark = pytest.mark.skipif(not cpu_fused_ops.available(), reason="no C compiler")
BF16_TOL = 2 ** -7  # one bf16 rounding step, relative


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.bfloat16
    err = ((ours.float() - ref.float()).abs() / (ref.float().abs() + 1e-2)).max().item()
    assert err <= 2 * BF16_TOL, f"relative error {err:.3g}"


def _fused(module: torch.nn.Module) -> torch.nn.Module:
    holder = torch.nn.Sequential(module, torch.nn.Linear(1, 1, dtype=torch.bfloat16))  # a bf16 "model"
    assert fuse_cpu_layers(holder) == 1
    return module


def test_rmsnorm_plain_and_with_residual_in_place():
    torch.manual_seed(0)
    ref_norm = RMSNorm(96, 1e-5, torch.float32)
    ref_norm.weight.data = torch.rand(96) + 0.5
    norm = _fused(RMSNorm(96, 1e-5, torch.bfloat16))
    norm.weight.data = ref_norm.weight.data.bfloat16()
    wide = torch.randn(7, 200).bfloat16()
    x = wide[:, 10:106]  # rows of a wider tensor, as q/k/v slices are
    _close(norm(x), ref_norm(x.float()))
    x, res = torch.randn(7, 96).bfloat16(), torch.randn(7, 96).bfloat16()
    ref_out, ref_res = ref_norm(x.float(), res.float())
    out, new_res = norm(x, res)
    assert out.data_ptr() == x.data_ptr() and new_res.data_ptr() == res.data_ptr()  # in place, as on CUDA
    _close(new_res, ref_res)
    _close(out, ref_out)


def test_rotary_in_place_on_strided_q_and_k():
    torch.manual_seed(1)
    head_dim, hq, hkv = 32, 4, 2
    rope = RopeConfig(theta=10000.0)
    ref_rot = RotaryEmbedding(head_dim, 64, rope)
    rot = _fused(RotaryEmbedding(head_dim, 64, rope))
    qkv = torch.randn(5, (hq + 2 * hkv) * head_dim).bfloat16()
    q, k, _ = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    pos = torch.tensor([0, 3, 17, 40, 63])
    ref_q, ref_k = ref_rot(pos, q.float(), k.float())
    out_q, out_k = rot(pos, q, k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    _close(out_q, ref_q)
    _close(out_k, ref_k)


def test_silu_and_mul():
    torch.manual_seed(2)
    x = (torch.randn(9, 2 * 80) * 4).bfloat16()
    _close(_fused(SiluAndMul())(x), SiluAndMul()(x.float()))


def test_fp32_layers_keep_their_own_forward():
    norm = RMSNorm(16, 1e-5, torch.float32)
    assert fuse_cpu_layers(torch.nn.Sequential(norm)) == 0
    assert "forward" not in vars(norm)
