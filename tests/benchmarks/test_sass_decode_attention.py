"""benchmarks/sass_decode_attention.py: the decode-attention stage 1 compiled for sm90 by the real compiler (a
fresh process without TRITON_INTERPRET), its main loop found in the SASS and counted; the M-side variants'
reason to exist checked there: with v_widen_rows the FP8 loop has no byte-wise shared loads and fewer
shared-memory instructions than the default's, and fewer still with qk_n_side too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.sass_decode_attention import main_loop, parse_args


def test_main_loop_is_the_largest_backward_branch() -> None:
    sass = """
        /*0000*/ MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/ LDS.U8 R2, [R3] ;
        /*0020*/ @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0030*/ HGMMA.64x16x16.F32 R4, R8, gdesc[UR4], R4 ;
        /*0040*/ LDS.U16 R2, [R3] ;
        /*0050*/ @!P1 FADD R2, R2, R3 ;
        /*0060*/ @P0 BRA `(.L_x_1) ;
        /*0070*/ EXIT ;
"""
    assert main_loop(sass) == ["HGMMA.64", "LDS.U16", "FADD", "BRA"]  # opcodes up to a lowercase shape


def test_parse_args_defaults() -> None:
    args = parse_args([])
    assert args.block_n == 128 and args.num_stages == 3 and "fp8_m_v_widen_rows" in args.variants


def test_v_widen_rows_drops_the_byte_loads_in_sm90_sass(tmp_path: Path) -> None:
    try:
        import triton
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"triton's compile API is unavailable: {e}")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")):
        pytest.skip("this triton ships no nvdisasm")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sass.json"
    root = Path(__file__).parents[2]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sass_decode_attention", "--variants", "fp8_m",
                           "fp8_m_v_widen_rows", "fp8_m_qk_n_side_v_widen_rows", "--output-file", str(out)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())["results"]
    base, widen, both = r["fp8_m"], r["fp8_m_v_widen_rows"], r["fp8_m_qk_n_side_v_widen_rows"]
    for v in (base, widen, both):  # the KV loop was found: its P V dot is wgmma on the M side
        assert v["loop_top"].get("HGMMA.64", 0) >= 16 and v["loop_instructions"] > 200, v
    assert widen["loop_byte_loads"] == 0 and both["loop_byte_loads"] == 0, (widen, both)
    assert both["loop_mio"] < widen["loop_mio"] < base["loop_mio"], (base["loop_mio"], widen["loop_mio"],
                                                                      both["loop_mio"])
