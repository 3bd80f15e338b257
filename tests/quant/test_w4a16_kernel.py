"""kernels/w4a16_gemm.py on CPU (Triton interpreter, fp32/fp16: its bf16 dot is wrong): the GEMM against its
torch reference for the GEMV loop, the tl.dot loop, split-K, ragged N, per-channel groups, bias and
symmetric weights; and the K-packed layout against a plain bit-by-bit unpacking."""

from __future__ import annotations

import pytest
import torch

from kernels.w4a16_gemm import (
    W4Config,
    dequantize_int4,
    pack_int4,
    pick_config,
    tile_k,
    unpack_int4,
    w4_dequantize,
    w4a16_gemm,
    w4a16_gemm_ref,
)


def _operands(m: int, n: int, k: int, group: int, zeros: bool, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qweight = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.002).half()
    z = torch.randint(1, 17, (k // group, n), generator=g, dtype=torch.uint8) if zeros else None
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, qweight, scales, z, bias


@pytest.mark.parametrize(("m", "n", "k", "group", "zeros", "dtype", "cfg"), [
    (1, 48, 256, 128, True, torch.float32, None),  # GEMV (nibble planes), split-K
    (1, 40, 256, 64, False, torch.float16, W4Config(1, 16, 64, 2)),  # ragged N, symmetric
    (1, 32, 512, 512, True, torch.float32, W4Config(1, 16, 128, 4)),  # per-channel: one group over K
    (3, 40, 256, 128, True, torch.float16, None),  # tl.dot, M padded to 16
    (20, 64, 256, 32, False, torch.float16, W4Config(32, 32, 32, 1)),
    (5, 48, 256, 128, True, torch.float32, W4Config(16, 16, 64, 2)),  # dot + split-K
    (5, 48, 256, 128, True, torch.float16, W4Config(16, 16, 128, 2, planes=True)),  # a dot per nibble plane
    (3, 40, 256, 64, True, torch.float32, W4Config(4, 16, 64, 2, gemv=True)),  # the GEMV over a few rows
    (2, 40, 256, 128, False, torch.float32, W4Config(1, 16, 128, 1)),  # block_m 1: a row per program
    (70, 40, 256, 64, True, torch.float16, None),  # above DEQUANT_MATMUL_M: dequantize, then matmul
])
def test_kernel_matches_reference(m, n, k, group, zeros, dtype, cfg) -> None:
    x, qw, s, z, b = _operands(m, n, k, group, zeros, dtype)
    got = w4a16_gemm(x, qw, s, z, group, b, cfg)
    ref = w4a16_gemm_ref(x, qw, s, z, group, b)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * float(ref.float().abs().max()))
    assert w4a16_gemm(x[:0], qw, s, z, group, b).shape == (0, n)  # an idle rank's empty batch


def test_dequantize_kernel_is_exact() -> None:
    _, qw, s, z, _ = _operands(1, 40, 256, 64, True, torch.float32)
    assert torch.equal(w4_dequantize(qw, s, z, 64, torch.float32), dequantize_int4(qw, s, z, 64))
    assert torch.equal(w4_dequantize(qw, s, None, 64, torch.float16), dequantize_int4(qw, s, None, 64).half())


def test_packing_matches_a_plain_unpacking() -> None:
    v = torch.randint(0, 16, (3, 24))
    words = pack_int4(v)
    assert words.shape == (3, 3) and words.dtype == torch.int32
    plain = torch.zeros_like(v)
    for r in range(3):
        for c in range(24):
            word = int(words[r, c // 8]) & 0xFFFFFFFF
            plain[r, c] = (word >> (4 * (c % 8))) & 0xF  # column 8j + i in nibble i of word j
    assert torch.equal(plain, v) and torch.equal(unpack_int4(words).long(), v)
    s, z = torch.tensor([[0.5], [2.0]]).t().half(), torch.tensor([[8], [3]], dtype=torch.uint8).t()
    w = dequantize_int4(pack_int4(torch.tensor([[0] * 8, [15] * 8])), s, z, 8)
    assert torch.equal(w, torch.tensor([[-4.0] * 8, [24.0] * 8]))  # (q - zero) * scale per output channel


def test_configs_and_bad_operands() -> None:
    assert tile_k(128) == 128 and tile_k(32) == 32 and tile_k(4096) == 128 and tile_k(48) == 16
    with pytest.raises(ValueError, match="multiple of 16"):
        tile_k(24)
    cfg = pick_config(1, 4096, 14336, 128, sm_count=132)  # 8B down_proj at batch 1: many blocks in flight
    assert cfg.block_m == 1 and cfg.split_k == 8 and triton_blocks(cfg, 4096) >= 2 * 132
    assert pick_config(16, 4096, 4096, 128).block_m == 16 and not pick_config(16, 4096, 4096, 128).planes
    assert pick_config(2, 4096, 4096, 128).gemv and pick_config(2, 4096, 4096, 128).block_m == 2
    x, qw, s, z, _ = _operands(2, 16, 64, 32, True, torch.float32)
    with pytest.raises(ValueError, match="do not multiply"):
        w4a16_gemm(x[:, :32], qw, s, z, 32)
    with pytest.raises(ValueError, match="scales"):
        w4a16_gemm(x, qw, s, z, 64)


def triton_blocks(cfg: W4Config, n: int) -> int:
    return -(-n // cfg.block_n) * cfg.split_k
