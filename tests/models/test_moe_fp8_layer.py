"""FusedMoE's FP8 experts at layer level: a checkpoint's fp8 expert tensors with per-tensor, per-channel or
128x128-block scales (Qwen3-*-FP8's weight_scale_inv, here 16x16 blocks) and quantize_fp8 at load; the CPU
path against the Triton kernel (interpreter) and the torch reference; TP=2 shards summing to the whole;
the loaders' errors."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import MoeQuant, dequantize_experts, fused_moe, fused_moe_ref
from runtime.distributed import ParallelGroup
from runtime.errors import ServerArgsError, WeightLoadError
from runtime.layers.fused_moe import DOWN, GATE, UP, FusedMoE

E, H, INTER, K = 4, 32, 32, 2
FP8 = torch.float8_e4m3fn


def _quantize(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert part [N, K] as a checkpoint stores it: fp8 and its scale (scalar / [N, 1] / [N/16, K/16])."""
    if scheme == "tensor":
        s = w.abs().amax() / 448.0
        return (w / s).to(FP8), s
    if scheme == "channel":
        s = w.abs().amax(dim=1, keepdim=True) / 448.0
        return (w / s).to(FP8), s
    n, k = w.shape
    s = w.view(n // 16, 16, k // 16, 16).abs().amax(dim=(1, 3)) / 448.0
    return (w / s.repeat_interleave(16, 0).repeat_interleave(16, 1)).to(FP8), s


def _checkpoint(scheme: str, seed: int = 0) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {GATE: (INTER, H), UP: (INTER, H), DOWN: (H, INTER)}
    return [{p: _quantize(torch.randn(*shape, generator=g) * 0.2, scheme) for p, shape in shapes.items()}
            for _ in range(E)]


def _load(ckpt, scheme: str, group: ParallelGroup) -> FusedMoE:
    moe = FusedMoE(E, H, INTER, group, torch.float32)
    moe.use_fp8_checkpoint((16, 16) if scheme == "block" else None)
    for e, parts in enumerate(ckpt):
        for part, (w, s) in parts.items():
            down = part == DOWN
            moe.weight_loader(moe.w2_weight if down else moe.w13_weight, w, (e, part))
            moe._scale_loader(moe.w2_weight_scale if down else moe.w13_weight_scale, s, (e, part))
    return moe


def _dequantized(ckpt, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    def deq(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if scheme == "block":
            return w.float() * s.repeat_interleave(16, 0).repeat_interleave(16, 1)
        return w.float() * s
    w13 = torch.stack([torch.cat([deq(*p[GATE]), deq(*p[UP])]) for p in ckpt])
    w2 = torch.stack([deq(*p[DOWN]) for p in ckpt])
    return w13, w2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _routing(m: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, H, generator=g)
    weights, ids = torch.softmax(torch.randn(m, E, generator=g), -1).topk(K)
    return x, weights, ids


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_checkpoint_experts_cpu_kernel_and_reference_agree(scheme: str) -> None:
    ckpt = _checkpoint(scheme)
    moe = _load(ckpt, scheme, ParallelGroup.single())
    assert moe.w13_weight.dtype == FP8 and moe.quant is not None
    w13, w2 = _dequantized(ckpt, scheme)
    quant = MoeQuant(moe.w13_weight_scale, moe.w2_weight_scale, moe.quant.block)
    # the stacks hold the checkpoint's numbers: dequantized, they are the weights the checkpoint means
    torch.testing.assert_close(dequantize_experts(moe.w13_weight, quant.w13_scale, quant.block), w13)
    torch.testing.assert_close(dequantize_experts(moe.w2_weight, quant.w2_scale, quant.block), w2)
    for m in (1, 7):
        x, wts, ids = _routing(m, seed=m)
        cpu = moe(x, wts, ids)  # the sorted per-expert path, emulating the kernel's rounding
        ref = fused_moe_ref(x, moe.w13_weight, moe.w2_weight, wts, ids, quant=quant)
        torch.testing.assert_close(cpu, ref, rtol=1e-4, atol=1e-5)
        kernel = fused_moe(x, moe.w13_weight, moe.w2_weight, wts, ids, quant=quant)  # Triton interpreter
        torch.testing.assert_close(kernel, ref, rtol=1e-3, atol=1e-4)
        plain = fused_moe_ref(x, w13, w2, wts, ids)  # the activations' fp8 rounding is all that differs
        assert _rel(cpu, plain) < 0.06  # e4m3 keeps 3 mantissa bits: ~2-4% per value


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_fp8_experts_tp2_shards_sum_to_the_whole(scheme: str) -> None:
    ckpt = _checkpoint(scheme, seed=3)
    whole = _load(ckpt, scheme, ParallelGroup.single())
    halves = [_load(ckpt, scheme, ParallelGroup(rank=r, size=2)) for r in range(2)]
    x, wts, ids = _routing(5)
    # the down GEMM's input is rounded per rank (its own half of I), so the halves' sum differs by rounding
    torch.testing.assert_close(halves[0](x, wts, ids) + halves[1](x, wts, ids), whole(x, wts, ids),
                               rtol=0.05, atol=0.02)


def test_quantize_fp8_at_load_stays_near_the_16_bit_experts() -> None:
    g = torch.Generator().manual_seed(5)
    moe = FusedMoE(E, H, INTER, ParallelGroup.single(), torch.float32)
    moe.w13_weight.data.copy_(torch.randn(E, 2 * INTER, H, generator=g) * 0.2)
    moe.w2_weight.data.copy_(torch.randn(E, H, INTER, generator=g) * 0.2)
    x, wts, ids = _routing(6)
    before = moe(x, wts, ids)
    moe.quantize_fp8()
    assert moe.w13_weight.dtype == FP8 and moe.w13_weight_scale.shape == (E, 2 * INTER)
    after = moe(x, wts, ids)
    assert _rel(after, before) < 0.08  # weights and activations both through e4m3


def test_fp8_expert_loader_errors() -> None:
    moe = FusedMoE(E, H, INTER, ParallelGroup.single(), torch.float32)
    moe.use_fp8_checkpoint((16, 16))
    moe.w13_weight.hf_name = "experts.0.gate_proj.weight"
    with pytest.raises(WeightLoadError, match="expected float8_e4m3fn"):
        moe.weight_loader(moe.w13_weight, torch.zeros(INTER, H), (0, GATE))
    moe.w13_weight_scale.hf_name = "experts.0.gate_proj.weight_scale_inv"
    with pytest.raises(WeightLoadError, match="block scales"):
        moe._scale_loader(moe.w13_weight_scale, torch.ones(3, 2), (0, GATE))
    # a TP shard that splits a 16-row block: refused by name, before anything loads
    odd = FusedMoE(E, H, 48, ParallelGroup(rank=0, size=2), torch.float32)
    with pytest.raises(ServerArgsError, match="--tensor-parallel-size"):
        odd.use_fp8_checkpoint((16, 16))
