"""W4a16Gemm: y = x @ dequant(W4)^T for 4-bit weight-only checkpoints (AWQ, GPTQ, compressed-tensors W4A16).

One weight layout serves every checkpoint format (runtime/model_executor/int4_weights.py converts at load):
- qweight [N, K/8] int32, packed along K: nibble i (bits 4i..4i+3) of word j of row n holds k = 8j + i
  (compressed-tensors' pack-quantized order; GPTQ's qweight is its transpose, AWQ's is repacked);
- scales [K/G, N] (fp16/bf16/fp32), one per group of G input columns and output channel;
- zeros [K/G, N] uint8 (the unsigned zero point, 0..16) or None: symmetric, zero point 8.
W[n, k] = (q[n, k] - zero[k // G, n]) * scale[k // G, n].

Why a Triton kernel with the dequantize inside the K loop: the packed weight is read once from HBM (a
quarter of bf16's bytes), so decode-sized M is ~4x less weight traffic than the bf16 GEMM. Each K tile lies
in one group (BLOCK_K divides G), so its zero and scale are one [BLOCK_N] vector each. A nibble becomes a
float without an int-to-float conversion (a slow instruction): OR-ing it into the mantissa of 2^23
(or of 128 in bf16, 1024 in fp16) and subtracting that constant plus the zero point is exact. At these
sizes the kernel is bound by that arithmetic, not by HBM, so the loops keep it to a shift, a mask-or, a
subtract and a multiply-add per weight.

The loops, picked by M (pick_config, from an H200 sweep):
- M <= 2 (gemv=True): a GEMV on CUDA cores, each dequantized tile times the rows. Nibble i of a tile's words is the K
  sub-tile {k0 + 8w + i}, so each of the 8 "planes" is one shift of the loaded words against x's columns
  at stride 8; (q - z) is exact in fp32, x is multiplied in fp32 and the group's scale applied once per
  tile. K is split 8 ways (fp32 partials summed by a second launch: deterministic, no atomics).
- 1 < M <= DEQUANT_MATMUL_M: tl.dot (M padded to 16) of x's tile and (q - z) in x's dtype (exact small
  integers), the scale applied per tile; nibbles interleaved into a [BLOCK_N, BLOCK_K] tile (planes=True:
  a dot per plane instead, slower with many rows).
- M > DEQUANT_MATMUL_M (prefill): one launch dequantizes the layer to x's dtype, cuBLAS multiplies.
Configs are picked by shape, nothing is allocated but the output (the partials, the dequantized weight),
and nothing syncs with the host: CUDA graphs capture it.

CPU tests run the kernel under TRITON_INTERPRET=1 on small shapes in fp32/fp16 (the interpreter's bf16 dot
is wrong); `w4a16_gemm_ref` is the torch reference (dequantize to fp32, one fp32 matmul, one rounding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8_gemv import SM_COUNT_DEFAULT, device_sm_count
from kernels.pdl import launch_options, pdl_enabled

PACK = 8  # 4-bit values per int32
SYM_ZERO = 8  # the zero point of symmetric 4-bit weights, in the unsigned 0..15 domain
# Above this M (prefill, big decode batches) the weight is dequantized to x's dtype (one launch, 2 bytes
# written per weight) and cuBLAS multiplies: its GEMM beats tl.dot over 4-bit tiles several times there
# (H200, Llama-8B shapes: benchmarks/results/w4a16_gemm_h200.json). The temporary is one layer's weight.
DEQUANT_MATMUL_M = 64


@dataclass(frozen=True, slots=True)
class W4Config:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    planes: bool = False  # M > 1, 128-column tiles: tl.dot per nibble plane (else one dot, interleaved nibbles)
    gemv: bool = False  # block_m > 1 without tl.dot: each dequantized tile times block_m rows (block_m 1 always)


@triton.jit
def _nibbles(words, BLOCK_K: tl.constexpr):
    """[BN, BLOCK_K / 8] int32 words → [BN, BLOCK_K] int32 nibbles (0..15), k = 8 * word + nibble."""
    w = tl.interleave(words, words)
    w = tl.interleave(w, w)
    w = tl.interleave(w, w)
    shifts = (tl.arange(0, BLOCK_K) % 8) * 4
    return (w >> shifts[None, :]) & 0xF


@triton.jit
def _as_dot_operand(q, z, DOT_KIND: tl.constexpr):
    """(q - z) for tl.dot: exact small integers in x's dtype, each from a mantissa OR and one subtraction."""
    if DOT_KIND == 1:  # bf16: 128 + q in the mantissa (ulp 1 up to 256)
        qh = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return qh - (z + 128).to(tl.bfloat16)[:, None]
    elif DOT_KIND == 2:  # fp16: 1024 + q
        qh = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        return qh - (z + 1024).to(tl.float16)[:, None]
    else:  # fp32 activations (tests, fp32 models): 2^23 + q
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - (z.to(tl.float32) + 8388608.0)[:, None]


@triton.jit
def _w4a16_kernel(X, QW, S, Z, B, Out, Part, M, N, K, stride_xm, stride_qn, stride_sg, stride_om,
                  GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                  GEMV: tl.constexpr, DOT_KIND: tl.constexpr, EVEN_N: tl.constexpr, DOT_PLANES: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    WORDS: tl.constexpr = BLOCK_K // 8
    # Nibble i of the tile's words is the K sub-tile {k0 + 8w + i}: 8 [BN, WORDS] planes, each one shift and
    # mask of the loaded words against x's columns at stride 8. The GEMV always takes them (no interleave,
    # whose re-layouts cost more than the strided x loads L1 serves: 1.2x faster on an H200, best config
    # against best config, w4a16_gemm_sweep_{interleave_gemv,m1}_h200.json); tl.dot only
    # where asked (WORDS >= 16): with many x rows the strided loads cost more than the interleave.
    PLANES: tl.constexpr = GEMV or (DOT_PLANES and WORDS >= 16)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, WORDS)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # K is a whole number of BLOCK_K tiles (BLOCK_K divides the group, the group divides K); each split
    # owns a contiguous run of them.
    tiles = K // BLOCK_K
    per_split = tl.cdiv(tiles, SPLIT_K)
    t_lo = pid_k * per_split
    t_hi = tl.minimum(t_lo + per_split, tiles)
    qw_ptrs = QW + offs_n[:, None].to(tl.int64) * stride_qn + (t_lo * WORDS + offs_w)[None, :]
    if GEMV and BLOCK_M == 1:
        acc2 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    elif GEMV:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, WORDS), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t_lo, t_hi):
        k0 = t * BLOCK_K
        g = k0 // GROUP
        if EVEN_N:
            words = tl.load(qw_ptrs)
            s = tl.load(S + g * stride_sg + offs_n).to(tl.float32)
        else:
            words = tl.load(qw_ptrs, mask=mask_n[:, None], other=0)
            s = tl.load(S + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            if EVEN_N:
                z = tl.load(Z + g * stride_sg + offs_n).to(tl.int32)
            else:
                z = tl.load(Z + g * stride_sg + offs_n, mask=mask_n, other=0).to(tl.int32)
        else:
            z = tl.full((BLOCK_N,), 8, tl.int32)
        if GEMV:
            # 2^23 + q exactly (q in the mantissa's low bits) minus 2^23 + z is (q - z): no int-to-float
            zf = (z.to(tl.float32) + 8388608.0)[:, None]
            if BLOCK_M == 1:
                tacc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
                for i in tl.static_range(8):
                    q = (words >> (4 * i)) & 0xF
                    x = tl.load(X + tl.program_id(2) * stride_xm + k0 + offs_w * 8 + i).to(tl.float32)
                    tacc += ((q | 0x4B000000).to(tl.float32, bitcast=True) - zf) * x[None, :]
                acc2 += tacc * s[:, None]  # the group's scale once per tile, not per weight
            else:  # a few rows: each dequantized plane feeds all of them
                tacc3 = tl.zeros((BLOCK_M, BLOCK_N, WORDS), dtype=tl.float32)
                for i in tl.static_range(8):
                    wf = (((words >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf
                    x = tl.load(X + offs_m[:, None] * stride_xm + (k0 + offs_w * 8 + i)[None, :],
                                mask=mask_m[:, None], other=0.0).to(tl.float32)
                    tacc3 += wf[None, :, :] * x[:, None, :]
                acc3 += tacc3 * s[None, :, None]
        elif PLANES:
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(8):
                wq = _as_dot_operand((words >> (4 * i)) & 0xF, z, DOT_KIND)
                x = tl.load(X + offs_m[:, None] * stride_xm + (k0 + offs_w * 8 + i)[None, :],
                            mask=mask_m[:, None], other=0.0)
                part = tl.dot(x, tl.trans(wq), part, input_precision="ieee" if DOT_KIND == 0 else "tf32")
            acc += part * s[None, :]
        else:
            wq = _as_dot_operand(_nibbles(words, BLOCK_K), z, DOT_KIND)
            x = tl.load(X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=mask_m[:, None], other=0.0)
            part = tl.dot(x, tl.trans(wq), input_precision="ieee" if DOT_KIND == 0 else "tf32")
            acc += part * s[None, :]
        qw_ptrs += WORDS
    if GEMV and BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    elif GEMV:
        acc = tl.sum(acc3, axis=2)
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        y = acc
        if HAS_BIAS:
            y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], y.to(Out.dtype.element_ty), mask=out_mask)
    else:
        tl.store(Part + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=out_mask)


@triton.jit
def _split_k_sum_kernel(Part, B, Out, M, N, stride_om, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                        BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(Part + (s * M + m) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs, acc.to(Out.dtype.element_ty), mask=mask)


def tile_k(group: int) -> int:
    """The K tile: the largest power of two <= 128 dividing the group (a tile never straddles groups)."""
    bk = 128
    while bk > 16 and group % bk:
        bk //= 2
    if group % bk:
        raise ValueError(f"w4a16: group size {group} is not a multiple of 16")
    return bk


def pick_config(m: int, n: int, k: int, group: int, sm_count: int = SM_COUNT_DEFAULT) -> W4Config:
    """From H200 sweeps of Llama-8B's shapes (benchmarks/results/w4a16_gemm_sweep_*_h200.json): M <= 2 is
    the fp32 GEMV over 64-row blocks with K split 8 ways where K has the tiles (split 8 beat 1-4 on every
    shape at M = 1, even gate_up's 448 blocks: more loads in flight); 2 < M <= 64 tl.dot (M padded to 16)
    over 64-column blocks, split-K up to 4 while N alone leaves fewer than 4 blocks per SM (the GEMV over 4
    rows tied with it). Above DEQUANT_MATMUL_M w4a16_gemm dequantizes and calls cuBLAS (no config)."""
    bk = tile_k(group)
    tiles = k // bk
    if m <= 2:
        split_k = 1
        while split_k < 8 and tiles >= 4 * split_k:
            split_k *= 2
        return W4Config(m, 64, bk, split_k, 4, 3, gemv=True)
    block_m = 16 if m <= 16 else 64
    split_k = 1
    blocks = triton.cdiv(n, 64) * triton.cdiv(m, block_m)
    while blocks * split_k < 4 * sm_count and split_k < 4 and tiles >= 4 * split_k:
        split_k *= 2
    return W4Config(block_m, 64, bk, split_k, 4, 4)


@triton.jit
def _dequant_kernel(QW, S, Z, Out, N, K, stride_qn, stride_sg, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    mask_n = offs_n < N
    words = tl.load(QW + offs_n[:, None].to(tl.int64) * stride_qn + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :],
                    mask=mask_n[:, None], other=0)
    g = k0 // GROUP
    s = tl.load(S + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(Z + g * stride_sg + offs_n, mask=mask_n, other=0).to(tl.float32)
    else:
        z = tl.full((BLOCK_N,), 8.0, tl.float32)
    q = (_nibbles(words, BLOCK_K) | 0x4B000000).to(tl.float32, bitcast=True)
    w = (q - (z + 8388608.0)[:, None]) * s[:, None]
    tl.store(Out + offs_n[:, None].to(tl.int64) * K + (k0 + tl.arange(0, BLOCK_K))[None, :],
             w.to(Out.dtype.element_ty), mask=mask_n[:, None])


def w4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` ((q - z) * s exact in fp32, rounded once), one Triton launch."""
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    bk = tile_k(group_size)
    _dequant_kernel[(triton.cdiv(n, 32), k // bk)](
        qweight, scales, zeros if zeros is not None else scales, out, n, k, qweight.stride(0), scales.stride(0),
        GROUP=group_size, HAS_ZEROS=zeros is not None, BLOCK_N=32, BLOCK_K=bk, num_warps=4)
    return out


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               group_size: int, bias: torch.Tensor | None = None, config: W4Config | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ dequant(qweight [N, K/8], scales [K/G, N], zeros [K/G, N] | None)^T
    + bias → [M, N] in x's dtype, fp32 accumulation. group_size: G (K itself for per-channel scales)."""
    _check(x, qweight, scales, zeros, group_size, bias)
    m, k = x.shape
    n = qweight.shape[0]
    if config is None and m > DEQUANT_MATMUL_M:
        w = w4_dequantize(qweight, scales, zeros, group_size, x.dtype)
        return torch.nn.functional.linear(x, w, bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or pick_config(m, n, k, group_size, device_sm_count(x.device))
    gemv = cfg.block_m == 1 or cfg.gemv
    part = (torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device) if cfg.split_k > 1 else out)
    pdl = pdl_enabled(x)
    dot_kind = {torch.bfloat16: 1, torch.float16: 2}.get(x.dtype, 0)
    b_ptr = bias if bias is not None else scales
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, triton.cdiv(m, cfg.block_m))
    _w4a16_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, b_ptr, out, part, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k,
        GEMV=gemv, DOT_KIND=dot_kind, EVEN_N=n % cfg.block_n == 0, DOT_PLANES=cfg.planes,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, USE_PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(pdl))
    if cfg.split_k > 1:
        block = min(1024, triton.next_power_of_2(n))
        _split_k_sum_kernel[(triton.cdiv(n, block), m)](
            part, b_ptr, out, m, n, out.stride(0), HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k, BLOCK=block,
            USE_PDL=pdl, **launch_options(pdl))
    return out


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
           group_size: int, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or qweight.dim() != 2 or x.shape[1] != qweight.shape[1] * PACK:
        raise ValueError(f"w4a16_gemm: x {tuple(x.shape)} and qweight {tuple(qweight.shape)} (K/8 words a row) "
                         "do not multiply")
    n, k = qweight.shape[0], x.shape[1]
    if qweight.dtype != torch.int32 or qweight.stride(1) != 1:
        raise ValueError("w4a16_gemm: qweight must be a row-contiguous int32 tensor")
    if group_size <= 0 or k % group_size or scales.shape != (k // group_size, n) or scales.stride(1) != 1:
        raise ValueError(f"w4a16_gemm: scales {tuple(scales.shape)} do not fit K {k} in groups of {group_size} "
                         f"and N {n}")
    if zeros is not None and (zeros.shape != scales.shape or zeros.stride() != scales.stride()):
        raise ValueError(f"w4a16_gemm: zeros {tuple(zeros.shape)} must match scales {tuple(scales.shape)}")
    if bias is not None and (bias.numel() != n or not bias.is_contiguous()):
        raise ValueError(f"w4a16_gemm: bias has {bias.numel()} values for {n} output channels")


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 → [R, 8C] uint8 (0..15): nibble i of word c becomes column 8c + i."""
    out = torch.empty(packed.shape[0], packed.shape[1] * PACK, dtype=torch.uint8, device=packed.device)
    for i in range(PACK):  # one nibble at a time: no [R, C, 8] int32 temporary (an 8B layer's would be ~1 GB)
        out[:, i::PACK] = (packed >> (4 * i)) & 0xF
    return out


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[R, 8C] integers in 0..15 → [R, C] int32, column 8c + i into nibble i of word c (unpack_int4's inverse)."""
    if values.shape[-1] % PACK:
        raise ValueError(f"pack_int4: {values.shape[-1]} columns is not a multiple of {PACK}")
    words = torch.zeros(values.shape[0], values.shape[1] // PACK, dtype=torch.int32, device=values.device)
    for i in range(PACK):  # disjoint bits: OR, and nibble 7's shift wraps into the sign bit as intended
        words |= values[:, i::PACK].to(torch.int32) << (4 * i)
    return words


def quantize_int4(w: torch.Tensor, group_size: int, zero_point: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [N, K] → (qweight [N, K/8], fp16 scales [K/G, N], uint8 zeros [K/G, N] or None): round to nearest over
    each group's min/max (zero_point) or its largest magnitude (symmetric, zero point 8). Dummy weights."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    if zero_point:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        zero = (-lo / scale).round().clamp(0, 15)
    else:
        scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-6).half().float()
        zero = torch.full_like(scale, SYM_ZERO)
    q = (g / scale[..., None]).round().add_(zero[..., None]).clamp_(0, 15).reshape(n, k)
    zeros = zero.to(torch.uint8).t().contiguous() if zero_point else None
    return pack_int4(q), scale.half().t().contiguous(), zeros


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int) -> torch.Tensor:
    """The fp32 weight [N, K] that qweight / scales / zeros stand for."""
    q = unpack_int4(qweight).to(torch.float32)  # [N, K]
    z = zeros.t().float() if zeros is not None else torch.full_like(scales.t(), SYM_ZERO, dtype=torch.float32)
    s = scales.t().float()
    return (q - z.repeat_interleave(group_size, dim=1)) * s.repeat_interleave(group_size, dim=1)


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: dequantize the weight to fp32, one fp32 matmul, the bias, one rounding."""
    _check(x, qweight, scales, zeros, group_size, bias)
    y = x.float() @ dequantize_int4(qweight, scales, zeros, group_size).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
