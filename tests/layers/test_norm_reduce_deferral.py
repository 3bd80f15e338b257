"""A row-parallel linear that leaves its partial sum to the RMSNorm after it (the default on a TP group with
the symmetric-memory all-reduce; SHOAL_FUSED_AR_NORM=0 turns it off): the linear and the norm ask the group
the same question of the same tensor, so either the linear all-reduces and the norm only normalises, or the
linear skips it and the norm's one launch reduces, adds and normalises; never both, never neither. A
stand-in two-rank group whose peer holds the same partial (the sum is twice it) runs it on CPU; the real
kernel is tested in tests/kernels/test_all_reduce_rmsnorm.py and on 2 GPUs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kernels.all_reduce_rmsnorm import all_reduce_add_rmsnorm_ref
from kernels.rmsnorm import fused_add_rmsnorm_ref
from runtime.distributed.parallel_group import ParallelGroup
from runtime.layers.linear import RowParallelLinear
from runtime.layers.norm import RMSNorm
from runtime.models.parallel_context import ParallelContext

EPS = 1e-6


@dataclass
class _Fast:
    ready: bool
    fuse_norm: bool = True
    calls: list[str] = field(default_factory=list)

    def can_add_rmsnorm(self, x: torch.Tensor) -> bool:
        return self.fuse_norm and self.ready

    def add_rmsnorm(self, x, residual, weight, eps):
        self.calls.append("fused")
        out, new_res = all_reduce_add_rmsnorm_ref([x, x], residual, weight, eps)
        if residual is not None:
            residual.copy_(new_res)
        return out


@dataclass(frozen=True, slots=True)
class _TwoRanks(ParallelGroup):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.fast.calls.append("all_reduce")  # type: ignore[union-attr]
        return x * 2


def _parts(ready: bool, defer: bool):
    torch.manual_seed(0)
    group = _TwoRanks(rank=0, size=2, fast=_Fast(ready))
    linear = RowParallelLinear(8, 6, False, group, dtype=torch.float32)
    linear.weight.data.normal_()
    linear.defer_to_norm = defer
    norm = RMSNorm(6, EPS, torch.float32)
    norm.weight.data.uniform_(0.5, 1.5)
    return group, linear, norm, torch.randn(3, 4), torch.randn(3, 6)


@pytest.mark.parametrize(("ready", "defer", "expected"), [
    (True, True, ["fused"]), (False, True, ["all_reduce"]), (True, False, ["all_reduce"])])
def test_exactly_one_reduction_and_the_same_result(ready: bool, defer: bool, expected: list[str]) -> None:
    group, linear, norm, x, residual = _parts(ready, defer)
    partial = x @ linear.weight.t()
    want_res = residual.clone()
    want_out = (partial * 2).clone()
    fused_add_rmsnorm_ref(want_out, want_res, norm.weight, EPS)
    # As LlamaDecoderLayer wires it: the norm gets the group exactly when the linear may defer to it.
    out, res = norm(linear(x), residual, group if defer else None)
    assert group.fast.calls == expected
    torch.testing.assert_close(res, want_res, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)


def test_norm_without_residual_reduces_too() -> None:
    group, linear, norm, x, _ = _parts(True, True)
    out = norm(linear(x), None, group)
    assert group.fast.calls == ["fused"]
    torch.testing.assert_close(out, norm((x @ linear.weight.t()) * 2), rtol=1e-5, atol=1e-5)


def test_context_offers_the_group_only_for_plain_tp_with_the_switch() -> None:
    on = _TwoRanks(rank=0, size=2, fast=_Fast(True))
    assert ParallelContext.tensor_parallel(on).norm_reduce_group is on
    assert ParallelContext(attn=on, mlp=on, dp_attention=True).norm_reduce_group is None
    off = _TwoRanks(rank=0, size=2, fast=_Fast(True, fuse_norm=False))
    assert ParallelContext.tensor_parallel(off).norm_reduce_group is None
    assert ParallelContext().norm_reduce_group is None  # one rank, no fast all-reduce


def test_llama_layers_defer_o_proj_and_down_proj(tmp_path) -> None:
    from tiny_models import make_tiny_model

    from runtime.model_config import ModelConfig
    from runtime.models.llama import LlamaModel

    cfg = ModelConfig.from_pretrained(str(make_tiny_model("llama", tmp_path / "m")))
    group = _TwoRanks(rank=0, size=2, fast=_Fast(True))
    model = LlamaModel(cfg, ParallelContext.tensor_parallel(group))
    for layer in model.layers:
        assert layer.norm_group is group
        assert layer.self_attn.o_proj.defer_to_norm and layer.mlp.down_proj.defer_to_norm
    plain = LlamaModel(cfg, ParallelContext())
    assert all(lay.norm_group is None and not lay.self_attn.o_proj.defer_to_norm for lay in plain.layers)
