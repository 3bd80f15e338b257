"""The one-launch per-token FP8 activation quantize (kernels/fp8_act_quant.py) in the Triton interpreter on
CPU: the same bits as the torch ops it replaces (runtime.layers.fp8_linear.quantize_per_token) for bf16 /
fp16 / fp32 rows, odd widths, rows of zeros and of -0.0, fp8 subnormals, every e4m3 rounding midpoint,
saturation, NaN and inf; the gated form against silu_and_mul then quantize; fp8_linear and a tiny Llama
with --quantization fp8 bit-equal with the kernel on and off; SHOAL_DECODE_FUSION=0 turning it off; and
the kernel compiled for sm90 (the interpreter accepts code the real compiler rejects)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.activation import silu_and_mul
from kernels.fp8_act_quant import act_quant_config, quantize_per_token_fp8
from runtime.layers import fp8_linear as fp8_linear_mod
from runtime.layers.activation import SiluAndMul
from runtime.layers.fp8_linear import (
    fp8_linear,
    fp8_linear_modules,
    quantize_per_channel,
    quantize_per_token,
    quantize_per_token_two_term,
)

F8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _assert_same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Equal fp8 bytes and fp32 scales, NaN scales in the same rows. Where torch's fp8 is NaN (inf / inf,
    anything / NaN) the byte is not compared: the interpreter casts a fp32 NaN to e4m3 as +-384 (0x7c/0xfc),
    while the GPU's cvt gives NaN; tests/gpu/test_fp8_act_quant_gpu.py checks those elements are NaN."""
    (q, s), (rq, rs) = got, want
    assert q.dtype == F8 and s.dtype == torch.float32 and q.shape == rq.shape and s.shape == rs.shape
    assert torch.equal(s.isnan(), rs.isnan()) and torch.equal(s[~s.isnan()], rs[~rs.isnan()])
    nan = rq.float().isnan()
    assert torch.equal(q.view(torch.uint8)[~nan], rq.view(torch.uint8)[~nan])


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows spanning 1e-6 .. 1e3 in magnitude (plus one outlier each), a row of zeros and one of -0.0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-6, 3, m)[:, None]
    x[:, int(torch.randint(k, (1,), generator=gen))] *= 50.0
    x[0] = 0.0
    if m > 1:
        x[1] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), [(1, 16), (2, 17), (5, 1000), (7, 4096), (3, 5003), (4, 16385)])
def test_matches_torch_ops_bit_for_bit(dtype: torch.dtype, m: int, k: int) -> None:
    x = _rows(m, k, dtype, seed=m * 1000 + k)
    _assert_same_bits(quantize_per_token_fp8(x), quantize_per_token(x))


def test_loop_path_is_taken_for_wide_rows() -> None:
    assert act_quant_config(16384)[1] and not act_quant_config(16385)[1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows(dtype: torch.dtype) -> None:
    x = _rows(6, 300, dtype, seed=3)[:, 20:270]  # row stride 300, 250 columns
    _assert_same_bits(quantize_per_token_fp8(x), quantize_per_token(x))


def test_every_rounding_midpoint_and_subnormal() -> None:
    """x / scale lands on every e4m3 value, every midpoint between neighbours (ties to even) and one fp32
    ulp either side of it, subnormals included, and past 448 (saturation)."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(F8).float()  # +0 .. 448, every finite e4m3 value
    mids = (grid[:-1] + grid[1:]) / 2
    vals = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                      torch.tensor([460.0, 1e4])])
    row = torch.cat([vals, -vals, torch.tensor([448.0])])  # 448 makes the scale fl32(448 * fl32(1/448))
    x = torch.stack([row, row * 0.37, row * 1e-3, row * 3.0e5])
    _assert_same_bits(quantize_per_token_fp8(x), quantize_per_token(x))


def test_nan_and_inf_propagate_like_torch() -> None:
    x = torch.randn(4, 64)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    x[2, 9] = -float("inf")
    x[3, 3] = float("nan")
    x[3, 4] = float("inf")
    _assert_same_bits(quantize_per_token_fp8(x), quantize_per_token(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "inter"), [(1, 16), (3, 47), (5, 352), (2, 16400)])
def test_gated_matches_silu_and_mul_then_quantize(dtype: torch.dtype, m: int, inter: int) -> None:
    gate_up = _rows(m, 2 * inter, dtype, seed=inter) + 0.01 * torch.randn(m, 2 * inter).to(dtype)
    _assert_same_bits(quantize_per_token_fp8(gate_up, gated=True), quantize_per_token(silu_and_mul(gate_up)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), [(1, 16), (5, 1000), (3, 5003), (2, 16385)])
def test_two_terms_match_the_torch_reference_bit_for_bit(dtype: torch.dtype, m: int, k: int) -> None:
    """--fp8-act-terms 2: the first M rows are the one-term codes, the next M the residual's (single pass
    and, past 16384 columns, the loop path), the same bits as quantize_per_token_two_term."""
    x = _rows(m, k, dtype, seed=7 * m + k)
    got = quantize_per_token_fp8(x, two_term=True)
    assert got[0].shape == (2 * m, k) and got[1].shape == (2 * m, 1)
    _assert_same_bits(got, quantize_per_token_two_term(x))


def test_two_terms_gated() -> None:
    gate_up = _rows(3, 2 * 352, torch.float32, seed=11) + 0.01 * torch.randn(3, 2 * 352)
    _assert_same_bits(quantize_per_token_fp8(gate_up, gated=True, two_term=True),
                      quantize_per_token_two_term(silu_and_mul(gate_up)))


def test_bad_input_gets_clear_errors() -> None:
    with pytest.raises(ValueError, match="2-D"):
        quantize_per_token_fp8(torch.randn(8))
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        quantize_per_token_fp8(torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="gate and up"):
        quantize_per_token_fp8(torch.randn(2, 7), gated=True)
    with pytest.raises(ValueError, match="no columns"):
        quantize_per_token_fp8(torch.randn(2, 0))
    q, s = quantize_per_token_fp8(torch.randn(0, 8))
    assert q.shape == (0, 8) and s.shape == (0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_same_output_with_the_kernel(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    w8, ws = quantize_per_channel(torch.randn(40, 96, generator=gen) * 0.05)
    x, b = torch.randn(2, 9, 96, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype)
    for use_scaled_mm in (True, False):
        for terms in (1, 2):
            want = fp8_linear(x, w8, ws, b, use_scaled_mm, fused_quant=False, act_terms=terms)
            got = fp8_linear(x, w8, ws, b, use_scaled_mm, fused_quant=True, act_terms=terms)
            assert got.shape == (2, 9, 40) and torch.equal(got, want)


def _driver(path: Path, monkeypatch: pytest.MonkeyPatch, fusion: str, dtype: str):
    sys.path.insert(0, str(Path(__file__).parents[1] / "model_executor"))
    from runner_driver import RunnerDriver

    # The kernel serves CUDA only; here the interpreter stands in for the GPU, so the layers take it too,
    # and the MLP's activation is the Triton silu_and_mul CUDA runs (CPU's own ops round differently).
    monkeypatch.setattr(fp8_linear_mod, "triton_act_quant_supported", lambda device: True)
    monkeypatch.setenv("SHOAL_DECODE_FUSION", fusion)
    monkeypatch.setenv("SHOAL_FP8_ACT_QUANT", "1")
    d = RunnerDriver(path, quantization="fp8", dtype=dtype)
    for module in d.runner.model.modules():
        if isinstance(module, SiluAndMul):
            module.forward = silu_and_mul
    return d


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_llama_fp8_logits_identical_with_kernel_on_and_off(tiny_llama, monkeypatch, dtype: str) -> None:
    from runtime.model_executor.forward_mode import ForwardMode

    logits = []
    for fusion in ("1", "0"):
        d = _driver(tiny_llama, monkeypatch, fusion, dtype)
        layers = fp8_linear_modules(d.runner.model)
        assert layers and all(m.fused_act_quant == (fusion == "1") for _, m in layers)
        rows = [d.new_row(), d.new_row()]
        _, a = d.step(ForwardMode.EXTEND, rows, [[7, 19, 23, 150, 151, 9, 88], [301, 42, 5, 66, 67]])
        _, b = d.step(ForwardMode.DECODE, rows, [[5], [11]])
        logits.append(torch.cat([a.next_token_logits, b.next_token_logits]))
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1])


_COMPILE_SCRIPT = """
import json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print(json.dumps({"skip": f"triton's compile API is unavailable: {e}"}))
    sys.exit(0)
from kernels.fp8_act_quant import _fp8_act_quant_kernel, act_quant_config, fp_fusion
out = []
cases = [(xdt, gated, k, False) for xdt in ("bf16", "fp16", "fp32") for gated in (False, True)
         for k in (4096, 14336, 28672)]
cases += [("bf16", gated, k, True) for gated in (False, True) for k in (4096, 28672)]  # two terms
for xdt, gated, k, two in cases:
            block, single, warps = act_quant_config(k)
            sig = {"X": "*" + xdt, "Q": "*fp8e4nv", "S": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i64",
                   "stride_qm": "i64", "GATED": "constexpr", "SINGLE_PASS": "constexpr", "TWO_TERM": "constexpr",
                   "BLOCK_K": "constexpr"}
            consts = {"GATED": gated, "SINGLE_PASS": single, "TWO_TERM": two, "BLOCK_K": block}
            c = triton.compile(ASTSource(fn=_fp8_act_quant_kernel, signature=sig, constexprs=consts),
                               target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": warps, "enable_fp_fusion": fp_fusion(two)})
            ptx = c.asm["ptx"]
            out.append({"case": [xdt, gated, k, two], "cubin": len(c.asm["cubin"]), "div_rn": "div.rn.f32" in ptx,
                        "e4m3_cvt": "e4m3x2" in ptx, "approx_div": "div.full" in ptx or "div.approx" in ptx,
                        "nan_max": "max.NaN.f32" in ptx, "inv_448": "0f3B124925" in ptx,
                        "rne_add_sub": "0f4B400000" in ptx and "0fCB400000" in ptx,
                        "fma": "fma.rn.f32" in ptx})
print(json.dumps({"results": out}))
"""


def test_compiles_for_sm90() -> None:
    """The real compiler, not the interpreter (a fresh process without TRITON_INTERPRET): every variant
    builds an sm90 cubin, with IEEE division (div.rn) for x / scale, NaN-propagating max, the scale as a
    multiply by fl32(1/448) (0x3B124925) and the hardware e4m3 cast; two-term variants have no FMA."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).parents[2]
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    assert len(report["results"]) == 22
    for r in report["results"]:
        # NaN-propagating max (torch's amax and clamp keep NaN) and the scale's multiply by fl32(1/448)
        # and the +- 1.5 * 2^23 rounding kept (not folded away as (a + c) - c == a)
        assert r["cubin"] > 0 and r["div_rn"] and r["e4m3_cvt"] and r["nan_max"] and r["inv_448"], r
        assert r["rne_add_sub"], r
        if r["case"][3]:  # two terms: x - q * s rounded twice like torch's ops, never one FMA
            assert not r["fma"], r
        if not r["case"][1]:  # gated: sigmoid's 1 / (1 + e) is approximate, as in kernels/activation.py
            assert not r["approx_div"], r
