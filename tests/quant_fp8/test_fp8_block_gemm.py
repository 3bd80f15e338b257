"""kernels/fp8_block_gemm.py in the Triton interpreter on CPU (e4m3 dots and casts work there): the
per-token-group quantize gives its torch reference's bits (short last groups, zeros, outliers; gated
against silu_and_mul then quantize), the block-scaled GEMM matches dequantize-then-matmul for every tile
config it picks (short last blocks in N and K, group_k wider than the K step); fp8_block_linear's kernel
and torch paths agree; and the kernels compile for sm90 with the real compiler (fp8 wgmma)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from block_fp8_checkpoints import quantize_blocks

from kernels.activation import silu_and_mul
from kernels.fp8_block_gemm import (
    dequantize_blocks,
    gemm_config,
    per_token_group_quant_fp8,
    per_token_group_quant_ref,
    w8a8_block_fp8_matmul,
    w8a8_block_fp8_matmul_ref,
)
from runtime.layers.fp8_block_linear import fp8_block_linear

F8 = torch.float8_e4m3fn


def _x(m: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m)[:, None]
    x[:, k // 3] *= 40.0  # an outlier column: only its own group's scale should grow
    x[0, : min(k, 40)] = 0.0  # a group (or part of one) of zeros keeps a finite scale
    return x.to(dtype)


def _same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, s), (rq, rs) = got, want
    assert q.dtype == F8 and q.shape == rq.shape and s.shape == rs.shape
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid of -4000
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "group"), [(1, 128, 128), (3, 320, 128), (5, 96, 32), (2, 40, 16)])
def test_group_quant_matches_reference_bits(dtype: torch.dtype, m: int, k: int, group: int) -> None:
    x = _x(m, k, dtype, seed=k)
    got = per_token_group_quant_fp8(x, group)
    assert got[1].shape == (m, -(-k // group))
    _same_bits(got, per_token_group_quant_ref(x, group))
    gate_up = torch.cat([x, _x(m, k, dtype, seed=k + 1)], 1)
    _same_bits(per_token_group_quant_fp8(gate_up, group, gated=True),
               per_token_group_quant_ref(silu_and_mul(gate_up), group))


def test_group_quant_padded_rows_for_scaled_mm() -> None:
    """rows=: torch._scaled_mm's 1x128 layout: rows padded (zero codes, unit scales), scales column-major."""
    x = _x(5, 256, seed=3)
    q, s = per_token_group_quant_fp8(x, 128, rows=8)
    assert q.shape == (8, 256) and s.shape == (8, 2) and s.stride() == (1, 8)
    _same_bits((q[:5], s[:5].contiguous()), per_token_group_quant_ref(x, 128))
    assert not q[5:].float().any() and torch.equal(s[5:], torch.ones(3, 2))


@pytest.mark.parametrize(("m", "n", "k", "block"), [
    (1, 256, 256, (128, 128)), (3, 72, 320, (24, 64)), (20, 320, 320, (128, 128)), (70, 96, 200, (32, 64)),
    (600, 48, 64, (16, 32))])
def test_block_gemm_matches_dequantized_matmul(m: int, n: int, k: int, block: tuple[int, int]) -> None:
    torch.manual_seed(m)
    w8, scale = quantize_blocks(torch.randn(n, k) * 0.05, block)
    xq, xs = per_token_group_quant_ref(_x(m, k, seed=m), block[1])
    want = w8a8_block_fp8_matmul_ref(xq, xs, w8, scale, block, torch.float32)
    configs = [gemm_config(m, n, k, block[1]), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, SWIZZLE_M=2)]
    if m <= 16:  # the GEMV at any rows, K steps of several groups, and a row count not a power of two
        configs.append(dict(GEMV=1, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=8, BLOCK_K=2 * block[1]))
    for cfg in configs:
        got = w8a8_block_fp8_matmul(xq, xs, w8, scale, block, torch.float32, cfg)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert w8a8_block_fp8_matmul(xq[:0], xs[:0], w8, scale, block, torch.float32).shape == (0, n)


def test_block_linear_kernel_and_torch_paths_agree() -> None:
    torch.manual_seed(1)
    w = torch.randn(96, 160) * 0.05
    w8, scale = quantize_blocks(w, (32, 32))
    torch.testing.assert_close(dequantize_blocks(w8, scale, (32, 32)), w, rtol=0.07, atol=1e-6)
    x, bias = torch.randn(2, 3, 160), torch.randn(96)
    ref = fp8_block_linear(x, w8, scale, (32, 32), bias, use_kernels=False)
    torch.testing.assert_close(fp8_block_linear(x, w8, scale, (32, 32), bias, use_kernels=True), ref,
                               rtol=1e-5, atol=1e-5)
    assert ref.shape == (2, 3, 96)
    exact = x @ w.t() + bias
    assert float((ref - exact).norm() / exact.norm()) < 0.05  # e4m3 on both sides: a few percent
    with pytest.raises(ValueError, match="do not fit block"):
        w8a8_block_fp8_matmul(*per_token_group_quant_ref(x[0], 32), w8, scale, (64, 32), torch.float32)


_COMPILE_SCRIPT = """
import json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print(json.dumps({"skip": f"triton's compile API is unavailable: {e}"}))
    sys.exit(0)
from kernels.fp8_block_gemm import _block_gemm_kernel, _block_gemv_kernel, _group_quant_kernel, gemm_config
out = []
# what the JIT specializes at run time: pointers and every int but M divisible by 16
attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12)}
for m in (1, 4, 16, 64, 256, 2048):
    cfg = dict(gemm_config(m, 4096, 4096, 128))
    gemv = cfg.pop("GEMV", 0)
    opts = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
    sig = {"A": "*fp8e4nv", "B": "*fp8e4nv", "C": "*bf16", "As": "*fp32", "Bs": "*fp32", "M": "i32", "N": "i32",
           "K": "i32", "stride_am": "i32", "stride_bn": "i32", "stride_cm": "i32", "stride_asm": "i32",
           "stride_bsn": "i32", **{c: "constexpr" for c in ("GROUP_N", "GROUP_K", *cfg)}}
    c = triton.compile(ASTSource(fn=_block_gemv_kernel if gemv else _block_gemm_kernel, signature=sig,
                                 constexprs={"GROUP_N": 128, "GROUP_K": 128, **cfg}, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = c.asm["ptx"]
    out.append({"m": m, "gemv": gemv, "cubin": len(c.asm["cubin"]), "mma": "mma.sync" in ptx,
                "vec16": "ld.global.v4.b32" in ptx,
                "wgmma": "wgmma.mma_async.sync.aligned.m64n" in ptx and ".e4m3.e4m3" in ptx})
for gated in (False, True):
    sig = {"X": "*bf16", "Q": "*fp8e4nv", "S": "*fp32", "K": "i32", "groups": "i32", "stride_xm": "i32",
           "stride_qm": "i32", "stride_sm": "i32", "stride_sg": "i32", "GROUP": "constexpr", "BLOCK": "constexpr",
           "GROUPS_PER": "constexpr", "GATED": "constexpr"}
    c = triton.compile(ASTSource(fn=_group_quant_kernel, signature=sig,
                                 constexprs={"GROUP": 128, "BLOCK": 128, "GROUPS_PER": 16, "GATED": gated}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    out.append({"gated": gated, "cubin": len(c.asm["cubin"]), "e4m3_cvt": "e4m3x2" in c.asm["ptx"]})
print(json.dumps({"results": out}))
"""


def test_compiles_for_sm90() -> None:
    """The real compiler (a fresh process without TRITON_INTERPRET): every kernel and tile config of an
    8B-shaped layer builds an sm90 cubin: the GEMV (M <= 4) streaming the weight in 16-byte loads at M 1,
    the MMA kernel on e4m3 wgmma from 64-row tiles (below, Triton upcasts 16-row tiles to f16 for mma.sync:
    there the weight read bounds it, not the MMA), and the quantize (plain and gated) on the e4m3 cast."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=Path(__file__).parents[2], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    assert len(report["results"]) == 8
    for r in report["results"]:
        assert r["cubin"] > 0 and r.get("e4m3_cvt", True), r
        if r.get("gemv") and r["m"] == 1:
            assert r["vec16"], r  # the weight streams in 16-byte loads
        elif "m" in r and not r["gemv"]:
            assert r["wgmma"] if r["m"] >= 64 else r["mma"], r
