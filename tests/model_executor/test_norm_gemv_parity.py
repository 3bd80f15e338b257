"""SHOAL_NORM_GEMV=1 end to end on CPU: a one-row decode step folds each decoder layer's two RMSNorms into
the qkv and gate_up GEMVs (kernels/fp8_gemv.NormInput). The interpreter's GEMV and norm kernels stand in
for CUDA's (the layers take them at one row in both runs), so the fused model must give the unfused one's
logits bit for bit, with every layer's fused path taken; FP8 weights (w8a16 GEMV) and qk-norm (qwen3) too.
On a GPU the sum order of 1 / rms may differ in its last bit (tests/gpu/test_dense_gemv_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from runner_driver import RunnerDriver

from kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from runtime.layers import fp8_linear
from runtime.layers.dense_gemm import DenseGemm
from runtime.layers.linear import ColumnParallelLinear
from runtime.layers.norm import RMSNorm
from runtime.model_executor.forward_mode import ForwardMode

PROMPT = [5, 17, 33, 101, 250, 7, 9]


def _kernel_norm(self: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None, group=None):
    """RMSNorm as CUDA runs it (the Triton kernels), here in the interpreter."""
    if residual is None:
        return rmsnorm(x, self.weight, self.eps)
    fused_add_rmsnorm(x, residual, self.weight, self.eps)
    return x, residual


def _decode_logits(path, flag: str, monkeypatch: pytest.MonkeyPatch, **args) -> tuple[list[torch.Tensor], int]:
    monkeypatch.setenv("SHOAL_NORM_GEMV", flag)  # read as the layers are built
    monkeypatch.setattr(RMSNorm, "forward", _kernel_norm)
    monkeypatch.setattr(DenseGemm, "serves", lambda self, x, w: x.dim() == 2 and x.shape[0] == 1)
    monkeypatch.setattr(fp8_linear, "use_small_m", lambda x2, w8, max_m=None: x2.shape[0] == 1)
    fused_calls = []
    real = ColumnParallelLinear.forward_normed

    def counting(self, *a, **kw):
        out = real(self, *a, **kw)
        fused_calls.append(out is not None)
        return out

    monkeypatch.setattr(ColumnParallelLinear, "forward_normed", counting)
    d = RunnerDriver(path, **args)
    row = d.new_row()
    _, out = d.step(ForwardMode.EXTEND, [row], [PROMPT])
    token, logits = out.next_token_logits.argmax(-1).item(), []
    for _ in range(2):
        _, out = d.step(ForwardMode.DECODE, [row], [[token]])
        logits.append(out.next_token_logits)
        token = out.next_token_logits.argmax(-1).item()
    assert all(fused_calls)
    return logits, len(fused_calls) // len(d.runner.model.model.layers)


@pytest.mark.parametrize("args", [{}, {"quantization": "fp8", "fp8_weight_only": True}], ids=["dense", "fp8"])
def test_norm_in_gemv_equals_the_norm_kernels(tiny_llama, monkeypatch: pytest.MonkeyPatch, args) -> None:
    fused, calls = _decode_logits(tiny_llama, "1", monkeypatch, **args)
    unfused, none = _decode_logits(tiny_llama, "0", monkeypatch, **args)
    assert none == 0 and calls == 4  # per layer: qkv and gate_up, two decode steps
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused))
    assert all(torch.isfinite(a).all() for a in fused)
