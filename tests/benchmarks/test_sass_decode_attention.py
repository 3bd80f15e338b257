"""benchmarks/sass_decode_attention.py: the decode-attention stage 1 compiled for sm90 by the real compiler (a
fresh process without TRITON_INTERPRET), its main loop found in the SASS and counted, and the KV pipeline's
depth read from the TTGIR: the reason the FP8 config takes num_stages 5 (two shared buffers per K/V tile, where
2-4 give one), and v_perm's: the N-side FP8 loop without byte-wise shared loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.sass_decode_attention import kv_buffers, main_loop, parse_args, programs_per_sm


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


def test_kv_buffers_reads_the_tile_buffers_leading_dimension() -> None:
    ir = """
    %a = ttg.local_alloc : () -> !ttg.memdesc<2x128xi32, #shared1, #smem, mutable> loc(#loc1)
    %b = ttg.local_alloc : () -> !ttg.memdesc<2x128x128xf8E4M3FN, #shared2, #smem, mutable> loc(#loc2)
    %c = ttg.local_alloc : () -> !ttg.memdesc<2x128x64xf8E4M3FN, #shared3, #smem, mutable> loc(#loc3)
    """
    assert kv_buffers(ir, 128) == 2 and kv_buffers(ir, 256) == 0


def test_parse_args_defaults() -> None:
    args = parse_args([])
    assert args.block_n == [128] and args.num_stages == [3, 5] and "fp8_m" in args.variants


def test_programs_per_sm_matches_what_nsight_compute_reported() -> None:
    # ncu on an H100 (results/ncu_decode_attention_h100.json): 141 and 168 registers, 74 KB and 41 KB, 4 warps:
    # 3 programs an SM each, by registers.
    assert programs_per_sm(141, 4, 74240) == 3 and programs_per_sm(168, 4, 41472) == 3
    assert programs_per_sm(114, 4, 74752) == 3  # registers would allow 4; shared memory holds 3
    assert programs_per_sm(106, 4, 56832) == 4 and programs_per_sm(64, 4, 0) == 8  # 8 by registers
    assert programs_per_sm(32, 1, 0) == 32


def test_fp8_kv_pipeline_depth_in_sm90_compile(tmp_path: Path) -> None:
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
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sass_decode_attention", "--variants", "fp8_m", "fp8_n",
                           "fp8_n_v_perm", "--num-stages", "3", "5", "--output-file", str(out)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())["results"]
    for v in (r["fp8_m_st3"], r["fp8_m_st5"]):  # the KV loop was found: the M-side dots are wgmma
        assert v["loop_top"].get("HGMMA.64", 0) >= 16 and v["loop_instructions"] > 200, v
    for form in ("fp8_m", "fp8_n"):  # one buffer per K/V tile up to stages 4, two from 5, in either form
        three, five = r[f"{form}_st3"], r[f"{form}_st5"]
        assert (three["kv_buffers"], five["kv_buffers"]) == (1, 2), (form, three["kv_buffers"], five["kv_buffers"])
        assert five["shared_bytes"] > three["shared_bytes"] + 2 * 16384  # K and V tiles double-buffered
    assert r["fp8_n_st5"]["loop_top"].get("HMMA.16816.F32", 0) >= 32  # the N-side loop: mma.sync
    plain, perm = r["fp8_n_st5"], r["fp8_n_v_perm_st5"]
    assert plain["loop_byte_loads"] == 128 and perm["loop_byte_loads"] == 0, (plain, perm)
    assert perm["loop_mio"] < plain["loop_mio"] and perm["kv_buffers"] == 2
    for v in r.values():  # the ELF's register count: within what a thread can have, and occupancy from it
        if isinstance(v, dict):
            assert 32 <= v["registers"] <= 255 and 1 <= v["programs_per_sm"] <= 8, v
