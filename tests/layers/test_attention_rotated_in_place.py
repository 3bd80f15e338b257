"""Attention.forward_rotary over a rotated FP8 pool when the backend stores the new K/V itself (flashinfer's
ragged prefill, MIXED batches): the rotary and the rotation run as one in-place launch
(KVRotation.rotary_rotate_), and the backend gets the same q/k/v bits as from the rotary followed by
KVRotation.rotate; with V's rotation in the weights v is left as it is. CUDA's path on CPU: the kernel in the
Triton interpreter (fp32)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import runtime.mem_cache.kv_rotation as kv_rotation
from kernels.rotary import apply_rotary
from runtime.layers.attention import Attention
from runtime.layers.rotary import RotaryEmbedding
from runtime.mem_cache.kv_rotation import KVRotation
from runtime.model_config import RopeConfig

HQ, HKV, D, T = 4, 2, 32, 9


class _StoringBackend:
    """Stores the new K/V itself: forward receives them and records what it got."""

    def __init__(self) -> None:
        self.got: tuple[torch.Tensor, ...] = ()

    def stores_first_ok(self, fb: object) -> bool:
        return False

    def forward(self, q, k, v, layer, fb) -> torch.Tensor:
        self.got = (q.clone(), k.clone(), v.clone())
        return torch.zeros_like(q)


@pytest.mark.parametrize("v_in_weights", [False, True])
def test_backend_that_stores_gets_rotary_and_rotation_from_one_launch(v_in_weights: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_DECODE_FUSION", "1")
    monkeypatch.setattr(Attention, "_kernel_device", staticmethod(lambda q: True))
    launches = []
    one_launch = kv_rotation.rotary_transform_
    monkeypatch.setattr(kv_rotation, "rotary_transform_", lambda *a: launches.append(a[1].shape[1]) or one_launch(*a))
    rotary = RotaryEmbedding(D, 512, RopeConfig(theta=10000.0))
    g = torch.Generator().manual_seed(1)
    mats = [torch.linalg.qr(torch.randn(HKV, D, D, generator=g))[0]]
    rotation = KVRotation("calibrated", HQ, mats, [m.transpose(1, 2).contiguous() for m in mats],
                          torch.linalg.qr(torch.randn(D, D, generator=g))[0], fused=True)
    if v_in_weights:
        rotation = rotation.with_v_in_weights()
    backend = _StoringBackend()
    fb = SimpleNamespace(token_to_kv_pool=SimpleNamespace(rotation=rotation), attn_backend=backend)
    layer = Attention(0, HQ, HKV, D, D ** -0.5)
    positions = torch.randint(0, 500, (T,), generator=g)
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=g)
    ref = qkv.clone()
    rq, rk, rv = ref.split([HQ * D, HKV * D, HKV * D], dim=-1)
    apply_rotary(positions, rq, rk, rotary.cos_sin_cache, D)
    want = rotation.rotate(0, rq, rk, rv)
    layer.forward_rotary(positions, *qkv.split([HQ * D, HKV * D, HKV * D], dim=-1), rotary, fb)
    assert launches == [HQ + HKV * (1 if v_in_weights else 2)]
    for got, exp in zip(backend.got, want, strict=True):
        assert torch.equal(got, exp)
    if v_in_weights:  # v untouched: the weights already gave it in the pool's basis
        assert torch.equal(backend.got[2], qkv[:, (HQ + HKV) * D:])
