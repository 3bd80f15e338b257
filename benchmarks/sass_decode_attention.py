"""What the decode-attention loop compiles to on an H100, without one: kernels/decode_attention.py's stage 1
compiled for sm90 by the installed Triton (pointers and strides 16-aligned, as at run time), its SASS read
with the nvdisasm Triton ships, and the main loop's instructions counted per 128-token tile and thread.

Why: on the GPU the FP8 (M-side) kernel reads KV at 2.42 TB/s, 72% of DRAM peak, issuing on 44% of cycles,
where the bf16 one reaches 3.06 TB/s (`results/ncu_decode_attention_h100.json`). The loop's instruction mix
says why without device time: the shared-memory (MIO) instructions that move a tile into the dots' register
layout, and how many instructions each KB of KV costs. Shared memory per program matches what Nsight
Compute reports on the device (41,472 B FP8, 74,240 B bf16 with the GPU image's Triton 3.6).

What it found: the instruction mix was not the limit (two variants that cut the FP8 loop's shared-memory
instructions from 260 to 96 a tile measured 0-30% slower; commit 03ee9a3), the pipeline depth is. The
KV loads hang off the slot-index load, so Triton's pipeliner keeps ONE shared buffer per K/V tile at
num_stages 2-4 and waits for the next tile's copy before any of this tile's math overlaps it; num_stages 5
gives two (kv_buffers below). A program of 16-bit KV still has 64 KB in flight, an FP8 one only 32 KB.
Then V: fp8_n_v_perm (V's channels permuted so the P V operand is whole words) has no LDS.U8 and half the
shared-memory instructions of fp8_n. Both measured faster on an H100 (benchmarks/README.md, eleventh session).
Occupancy too, from the cubin: registers a thread (its ELF's EIATTR_REGCOUNT), programs an SM by registers
and shared memory, and the KV bytes in flight an SM that gives (programs x buffers x tile). With Triton 3.6
fp8_n at stages 5 takes 202 registers (2 programs an SM), fp8_n_v_perm 114 (3, by shared memory).

    python -m benchmarks.sass_decode_attention --output-file benchmarks/results/sass_decode_attention_stages_triton36.json

The loop is the largest backward branch's body (the software-pipelined KV loop). CPU only is fine."""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks.common import write_result

# name: (kv dtype, M side, fp16 math, v_perm); 32/8 heads, head_dim 128, one split (the defaults' shapes)
VARIANTS = {
    "bf16_n_heads_first": ("bf16", False, False, False),
    "fp8_m": ("fp8e4nv", True, True, False),
    "fp8_n": ("fp8e4nv", False, True, False),
    "fp8_n_v_perm": ("fp8e4nv", False, True, True),
}
_MIO = ("LDS", "STS", "LDSM", "SHFL")
_ALIGNED = ("Q", "K_Buffer", "V_Buffer", "Req_To_Token", "Req_Pool_Indices", "Seq_Lens", "Mid", "Out", "Counter",
            "stride_qb", "stride_qh", "stride_kbs", "stride_kh", "stride_vbs", "stride_vh", "stride_req", "stride_ob",
            "stride_oh")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--block-n", type=int, nargs="+", default=[128], help="tiles other than 128 add _bnN to keys")
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, nargs="+", default=[3, 5], help="each gives keys NAME_stN")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def compile_stage1(kv: str, m_side: bool, f16: bool, v_perm: bool = False, block_n: int = 128, num_warps: int = 4,
                   num_stages: int = 3) -> Any:
    """The stage-1 kernel compiled for sm90 (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.decode_attention import _MIN_BLOCK_KV, _decode_stage1_kernel

    sig = {"Q": "*bf16", "K_Buffer": "*" + kv, "V_Buffer": "*" + kv, "Req_To_Token": "*i32",
           "Req_Pool_Indices": "*i64", "Seq_Lens": "*i64", "Mid": "*fp32", "Out": "*bf16", "Counter": "*i32",
           "qk_scale": "fp32", "v_scale": "fp32"}
    sig.update({n: "i32" for n in ("stride_qb", "stride_qh", "stride_kbs", "stride_kh", "stride_vbs", "stride_vh",
                                   "stride_req", "stride_mid_b", "stride_mid_h", "stride_mid_s", "stride_ob",
                                   "stride_oh", "stride_cnt")})
    consts = {"KV_GROUP": 4, "NUM_SPLITS": 1, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_H": 16, "VALID_H": 4,
              "BLOCKS_PER_GROUP": 1, "BLOCK_N": block_n, "MIN_BLOCK_KV": _MIN_BLOCK_KV, "WINDOW": 0,
              "KV_FP8": kv != "bf16", "FUSE_MERGE": False, "F16_MATH": f16, "USE_PDL": False,
              "HEADS_FIRST": not m_side, "KV_ROWS_M": m_side, "V_PERM": v_perm}
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in _ALIGNED}
    return triton.compile(ASTSource(fn=_decode_stage1_kernel, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def disassemble(cubin: bytes) -> str:
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def main_loop(sass: str) -> list[str]:
    """The opcodes (with modifiers) of the largest loop: from a label to the last branch back to it."""
    addr_re = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*)")
    instrs: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending: str | None = None
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            pending = label.group(1)
            continue
        m = addr_re.match(line)
        if m:
            addr = int(m.group(1), 16)
            instrs.append((addr, m.group(2)))
            if pending:
                labels[pending], pending = addr, None
    best: list[str] = []
    for addr, ins in instrs:
        m = re.search(r"BRA\s+`?\(?\.(L_x_\d+)", ins)
        if m and labels.get(m.group(1), addr) < addr:
            body = [i for a, i in instrs if labels[m.group(1)] <= a <= addr]
            if len(body) > len(best):
                best = body
    ops = []
    for ins in best:
        m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", ins)
        if m:
            ops.append(m.group(1))
    return ops


def kv_buffers(ttgir: str, block_n: int) -> int:
    """How many tiles of K the software pipeline keeps in shared memory: the leading dimension of the K tile's
    buffer (1: the next tile's copy is waited for before any of this one's math overlaps it, in one program)."""
    found = re.findall(r"local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x(\d+)x(\d+)x", ttgir)
    depths = [int(n) for n, a, b in found if block_n in (int(a), int(b))]
    return max(depths, default=0)


def register_count(cubin: bytes) -> int:
    """Registers a thread of the (one) kernel in a cubin: its .nv.info section's EIATTR_REGCOUNT (attribute
    0x2f, format 0x04: a function index and the count), read from the ELF without a driver."""
    sh_off = struct.unpack_from("<Q", cubin, 0x28)[0]
    sh_size, sh_num, sh_strndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, sh_off + i * sh_size) for i in range(sh_num)]
    names = sections[sh_strndx][4]
    for name, *_, offset, size, _link, _info, _align, _entsize in sections:
        if cubin[names + name:cubin.index(b"\0", names + name)] != b".nv.info":
            continue
        p = offset
        while p + 4 <= offset + size:
            fmt, attr, length = cubin[p], cubin[p + 1], struct.unpack_from("<H", cubin, p + 2)[0]
            if fmt == 0x04 and attr == 0x2F:
                return struct.unpack_from("<I", cubin, p + 8)[0]
            p += 4 + (length if fmt == 0x04 else 0)  # formats 1-3 keep their value in the header
    raise ValueError("no EIATTR_REGCOUNT in the cubin's .nv.info")


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int) -> int:
    """Resident programs an H100 SM holds: 64K registers (allocated per warp in 256-register units), 228 KB of
    shared memory (1 KB reserved per program), 64 warps, 32 programs."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(65536 // (per_warp * num_warps), 233472 // (shared_bytes + 1024), 64 // num_warps, 32)


def describe(kv: str, m_side: bool, f16: bool, v_perm: bool, block_n: int, num_warps: int, num_stages: int
             ) -> dict[str, Any]:
    c = compile_stage1(kv, m_side, f16, v_perm, block_n, num_warps, num_stages)
    ops = main_loop(disassemble(c.asm["cubin"]))
    hist = collections.Counter(ops)
    mio = sum(n for op, n in hist.items() if op.split(".")[0] in _MIO)
    tile_kb = 2 * block_n * 128 * (1 if kv != "bf16" else 2) / 1024  # K + V of one KV head
    regs, buffers = register_count(c.asm["cubin"]), kv_buffers(c.asm["ttgir"], block_n)
    programs = programs_per_sm(regs, num_warps, c.metadata.shared)
    return {"shared_bytes": c.metadata.shared, "kv_buffers": buffers, "registers": regs,
            "programs_per_sm": programs, "kv_kb_in_flight_per_sm": programs * buffers * tile_kb,
            "loop_instructions": len(ops), "loop_mio": mio,
            "loop_byte_loads": hist.get("LDS.U8", 0), "instructions_per_kb": len(ops) / tile_kb,
            "mio_per_kb": mio / tile_kb, "tile_kb_per_program": tile_kb,
            "loop_top": dict(hist.most_common(24))}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import triton

    results: dict[str, Any] = {"triton": triton.__version__}
    for name, block_n, stages in itertools.product(args.variants, args.block_n, args.num_stages):
        key = f"{name}{'' if block_n == 128 else f'_bn{block_n}'}_st{stages}"
        results[key] = r = describe(*VARIANTS[name], block_n, args.num_warps, stages)
        print(f"{key}: shared {r['shared_bytes']} B, {r['registers']} registers, {r['programs_per_sm']} programs "
              f"an SM, {r['kv_buffers']} KV buffers ({r['kv_kb_in_flight_per_sm']:.0f} KB an SM), "
              f"loop {r['loop_instructions']} instructions "
              f"({r['instructions_per_kb']:.1f}/KB), MIO {r['loop_mio']} ({r['mio_per_kb']:.1f}/KB), "
              f"LDS.U8 {r['loop_byte_loads']}", flush=True)
    if args.output_file:
        write_result(args.output_file, "sass_decode_attention", results, vars(args),
                     argv=["benchmarks/sass_decode_attention.py", *(argv if argv is not None else sys.argv[1:])])
    return results


if __name__ == "__main__":
    main()
