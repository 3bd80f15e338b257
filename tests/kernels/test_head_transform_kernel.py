"""kernels/head_transform.py in the Triton interpreter (fp32: the interpreter's tl.dot is wrong in bf16):
each head of a strided [T, H, D] view times its own matrix, in place, against torch; and KVRotation's
one-launch path over adjacent q/k/v views of a qkv row against its per-tensor torch path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.head_transform import head_transform_
from kernels.kv_store import store_kv
from kernels.rotary import apply_rotary
from kernels.rotary_transform_kv_store import rotary_transform_, rotary_transform_kv_store
from runtime.layers.rotary import RotaryEmbedding
from runtime.mem_cache.kv_rotation import KVRotation
from runtime.model_config import RopeConfig

D = 32


@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_each_head_times_its_matrix_in_place(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    buf = torch.randn(tokens, 7 * D + 3, generator=g)  # a row stride wider than the heads
    x = buf[:, : 5 * D].view(tokens, 5, D)
    mats = torch.randn(3, D, D, generator=g)
    head_map = torch.tensor([2, 0, 1, 1, 0], dtype=torch.int32)
    want = torch.einsum("thd,thde->the", x, mats[head_map.long()][None].expand(tokens, -1, -1, -1))
    rest = buf[:, 5 * D:].clone()
    out = head_transform_(x, mats, head_map)
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(buf[:, 5 * D:], rest)  # nothing outside the heads written


def test_bad_shapes_are_refused() -> None:
    x = torch.zeros(2, 3, D)
    with pytest.raises(ValueError, match="mats must be"):
        head_transform_(x, torch.zeros(1, D, D + 1), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="head_map must hold 3"):
        head_transform_(x, torch.zeros(1, D, D), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="power of 2 >= 32"):
        head_transform_(torch.zeros(2, 3, 16), torch.zeros(1, 16, 16), torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("mode", ["hadamard", "calibrated"])
def test_rotation_one_launch_equals_per_tensor_path(mode: str) -> None:
    hq, hkv, t = 4, 2, 9
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, hkv, D, generator=g) * torch.linspace(0.1, 5, D)
    y = torch.randn(64, hkv * 2, D, generator=g) * torch.linspace(5, 0.1, D)
    sk = torch.einsum("thd,the->hde", x, x) / 64
    sq = torch.einsum("thd,the->hde", y[:, :hkv], y[:, :hkv]) / 64  # any positive moments will do here
    args = ((1, hq, hkv, D, torch.float32, "cpu") if mode == "hadamard" else (hq, [sq], [sk], torch.float32, "cpu"))
    make = KVRotation.hadamard if mode == "hadamard" else KVRotation.calibrated
    fused, plain = make(*args, fused=True), make(*args, fused=False)
    qkv = torch.randn(t, (hq + 2 * hkv) * D, generator=g)
    q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
    before = qkv.clone()
    want = plain.rotate(0, q, k, v)
    got = fused.rotate(0, q, k, v)
    assert got[0].data_ptr() == qkv.data_ptr()  # transformed in place in the qkv row
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    o = torch.randn(t, hq * D, generator=g)
    torch.testing.assert_close(fused.restore_output(o.clone()), plain.restore_output(o), rtol=1e-5, atol=1e-5)
    # Not one qkv row (e.g. Qwen3's normed q/k are new tensors): one launch per tensor, same values.
    q2, k2, v2 = before.split([hq * D, hkv * D, hkv * D], dim=-1)
    got2 = fused.rotate(0, q2.clone(), k2.clone(), v2.clone())
    for a, b in zip(got2, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


HQ, HKV, SLOTS = 4, 2, 64


def _fused_case(tokens: int) -> tuple:
    """A qkv row of HQ + 2 HKV heads, its positions and slots, and per-head matrices (q heads share their KV
    head's, v heads one)."""
    g = torch.Generator().manual_seed(tokens)
    rot = RotaryEmbedding(D, 512, RopeConfig(theta=10000.0))
    mats = torch.randn(2 * HKV + 1, D, D, generator=g) / D ** 0.5
    head_map = torch.tensor([0, 0, 1, 1, 2, 3, 4, 4], dtype=torch.int32)
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, generator=g) * 3
    positions = torch.randint(0, 500, (tokens,), generator=g)
    loc = torch.randperm(SLOTS - 1, generator=g)[:tokens] + 1
    return rot, mats, head_map, qkv, positions, loc


def _rotary_then_transform(qkv: torch.Tensor, positions: torch.Tensor, rot: RotaryEmbedding, mats: torch.Tensor,
                           head_map: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """apply_rotary, then head_transform_ of the first `heads` heads, on a copy: (row, q, k, v) views."""
    ref = qkv.clone()
    q, k, v = ref.split([HQ * D, HKV * D, HKV * D], dim=-1)
    apply_rotary(positions, q, k, rot.cos_sin_cache, D)
    head_transform_(ref.view(ref.shape[0], -1, D)[:, :heads], mats, head_map[:heads])
    return ref, q, k, v


@pytest.mark.parametrize("v_as_is", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 20])
def test_fused_rotary_transform_store_equals_the_three_launches(tokens: int, v_as_is: bool) -> None:
    """One launch (rotary of q/k, each head times its matrix, k/v quantized into FP8 slots) against
    apply_rotary + head_transform_ + store_kv on the same qkv row: the same q bits and the same pool bytes.
    v_as_is (V's rotation folded into the weights): v heads stored as they are."""
    rot, mats, head_map, qkv, positions, loc = _fused_case(tokens)
    tokens = qkv.shape[0]
    k_scale, v_scale = 0.05, 0.02
    want_kv = [torch.zeros(SLOTS, HKV, D, dtype=torch.float8_e4m3fn) for _ in range(2)]
    ref, _, k, v = _rotary_then_transform(qkv, positions, rot, mats, head_map, HQ + HKV * (1 if v_as_is else 2))
    store_kv(*want_kv, loc, k.view(tokens, HKV, D), v.view(tokens, HKV, D), k_scale, v_scale)
    got_kv = [torch.zeros_like(b) for b in want_kv]
    rotary_transform_kv_store(positions, qkv.view(tokens, -1, D), rot.cos_sin_cache, mats, head_map, HQ,
                              *got_kv, loc, k_scale, v_scale, v_as_is=v_as_is)
    assert torch.equal(qkv[:, : HQ * D], ref[:, : HQ * D])
    for got, want in zip(got_kv, want_kv):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got_kv[0][loc].float().abs().sum() > 0 and got_kv[0][0].float().abs().sum() == 0


@pytest.mark.parametrize("with_v", [False, True])
@pytest.mark.parametrize("tokens", [3, 70])
def test_in_place_rotary_transform_equals_rotary_then_transform(tokens: int, with_v: bool) -> None:
    """rotary_transform_: the rotary then head_transform_ over q, k (and v) heads in place, one launch;
    heads past those given are not touched."""
    heads = HQ + HKV * (2 if with_v else 1)
    rot, mats, head_map, qkv, positions, _ = _fused_case(tokens)
    ref = _rotary_then_transform(qkv, positions, rot, mats, head_map, heads)[0]
    view = qkv.view(tokens, -1, D)
    rotary_transform_(positions, view[:, :heads], rot.cos_sin_cache, mats, head_map[:heads], HQ, HKV)
    assert torch.equal(qkv, ref)
    with pytest.raises(ValueError, match="neither 4 q"):
        rotary_transform_(positions, view[:, :HQ + 1], rot.cos_sin_cache, mats, head_map[:HQ + 1], HQ, HKV)

_COMPILE_SCRIPT = """
import json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print(json.dumps({"skip": f"triton's compile API is unavailable: {e}"}))
    sys.exit(0)
from kernels.head_transform import _head_transform_kernel
from kernels.rotary_transform_kv_store import _rotary_transform_kv_store_kernel
out = []
for xdt, d, bt in (("bf16", 64, 16), ("bf16", 128, 16), ("bf16", 128, 64), ("fp32", 64, 64)):
    sig = {"X": "*" + xdt, "Mats": "*" + xdt, "HeadMap": "*i32", "num_tokens": "i32", "stride_xt": "i64",
           "stride_xh": "i64", "stride_mm": "i64", "D": "constexpr", "BLOCK_T": "constexpr", "IEEE": "constexpr"}
    consts = {"D": d, "BLOCK_T": bt, "IEEE": xdt == "fp32"}
    c = triton.compile(ASTSource(fn=_head_transform_kernel, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4 if d <= 64 else 8})
    ptx = c.asm["ptx"]
    out.append({"case": [xdt, d, bt], "cubin": len(c.asm["cubin"]), "mma": "wgmma" in ptx or "mma.sync" in ptx,
                "tf32": ".tf32" in ptx})
for d in (64, 128):
    sig = {"Positions": "*i64", "QKV": "*bf16", "Cos_Sin": "*fp32", "Mats": "*bf16", "HeadMap": "*i32",
           "K_Buffer": "*fp8e4nv", "V_Buffer": "*fp8e4nv", "Loc": "*i64", "num_tokens": "i32",
           **{n: "i64" for n in ("stride_t", "stride_h", "stride_cs", "stride_mm", "stride_kbs", "stride_kbh",
                                 "stride_vbs", "stride_vbh")}, "inv_k_scale": "fp32", "inv_v_scale": "fp32",
           **{n: "constexpr" for n in ("NUM_Q_HEADS", "NUM_KV_HEADS", "D", "BLOCK_T", "IEEE", "QUANT", "IN_PLACE",
                                       "V_AS_IS")}}
    for in_place, v_as_is in ((False, False), (False, True), (True, False)):
        consts = {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "D": d, "BLOCK_T": 16, "IEEE": False, "QUANT": not in_place,
                  "IN_PLACE": in_place, "V_AS_IS": v_as_is}
        c = triton.compile(ASTSource(fn=_rotary_transform_kv_store_kernel, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4 if d <= 64 else 8})
        ptx = c.asm["ptx"]
        out.append({"case": ["bf16", d, "fused", in_place, v_as_is], "cubin": len(c.asm["cubin"]),
                    "mma": "wgmma" in ptx or "mma.sync" in ptx, "tf32": ".tf32" in ptx})
print(json.dumps({"results": out}))
"""


def test_compiles_for_sm90() -> None:
    """The real compiler (a fresh process without TRITON_INTERPRET): bf16 tiles go through tensor cores,
    fp32 ones stay IEEE (no TF32)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).parents[2]
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    for r in report["results"]:
        assert r["cubin"] > 0 and not r["tf32"], r
        assert r["mma"] == (r["case"][0] == "bf16"), r
