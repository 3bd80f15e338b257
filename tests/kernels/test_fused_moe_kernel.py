"""kernels/fused_moe: the sorted, padded expert layout (moe_align's Triton kernel against its torch form) and
the grouped-GEMM MoE against its torch reference, over each tile family (16/64-row blocks, split K), in the
Triton interpreter on CPU (fp32: the interpreter's bf16 tl.dot is wrong)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import MoeConfig, fused_moe, fused_moe_ref, moe_align, moe_align_torch, pick_config


def test_moe_align_groups_pads_and_bounds() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 3]])
    sorted_ids, expert_ids, total = moe_align(ids, num_experts=5, block_m=4)
    n = ids.numel()
    assert sorted_ids.numel() == 24  # the bound 8 + min(5, 8) * 3 = 23, rounded up to whole 4-row blocks
    assert int(total) == 16  # experts 0, 1, 2, 3 each one 4-row block (expert 2 has 4 rows exactly)
    layout = sorted_ids[: int(total)]  # past total nothing is written: the GEMMs never read it
    blocks = layout.view(-1, 4)
    flat = ids.reshape(-1)
    for b, row in enumerate(blocks):
        real = row[row < n]
        assert (flat[real] == expert_ids[b]).all()  # each block holds only its expert's pairs
    assert sorted(layout[layout < n].tolist()) == list(range(n))  # every (token, slot) pair exactly once
    assert int((layout == n).sum()) == 8  # the rest are pads
    # the layout's size depends only on M, k and E, not on the routing (fixed shapes for CUDA graphs)
    other = moe_align(torch.zeros_like(ids), num_experts=5, block_m=4)
    assert other[0].shape == sorted_ids.shape and other[1].shape == expert_ids.shape


@pytest.mark.parametrize(("m", "k", "e", "block_m"), [
    (1, 8, 128, 16), (37, 3, 16, 4),  # the one-program form (<= 128 pairs)
    (300, 8, 128, 64), (33, 8, 8, 32), (257, 1, 60, 16),  # chunked: 75 / 9 (the last partial) / 9 chunks
])
def test_moe_align_kernel_matches_torch(m: int, k: int, e: int, block_m: int) -> None:
    g = torch.Generator().manual_seed(m)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    got, want = moe_align(ids, e, block_m, use_kernel=True), moe_align_torch(ids, e, block_m)
    total = int(want[2])
    assert int(got[2]) == total
    # one token's slots (top-k: distinct experts) bound the layout by the used experts, not all E
    assert got[0].numel() == want[0].numel() <= m * k + min(e, m * k) * block_m
    assert torch.equal(got[0][:total], want[0][:total])  # stable: ascending ids within an expert
    assert torch.equal(got[1][: total // block_m], want[1][: total // block_m])


@pytest.mark.parametrize(("m", "e", "k", "h", "inter", "configs"), [
    (1, 8, 2, 40, 24, None),       # decode: one token, sizes not multiples of the tiles
    (6, 4, 2, 32, 48, None),
    (37, 16, 3, 64, 80, None),     # more pairs than one block per expert; some experts unused
    (40, 4, 2, 32, 48, None),      # 32-row blocks (20 rows an expert)
    (70, 2, 2, 32, 48, None),      # 64-row blocks (prefill)
    (12, 2, 2, 32, 48, (MoeConfig(128, 32, 16, 8, 4), MoeConfig(128, 16, 32, 8, 4))),  # 128-row blocks
    # split K in the down GEMM: 3 splits of 32 over K 80 (the last one partial), and 2 over an even K
    (5, 8, 2, 48, 80, (MoeConfig(16, 32, 32), MoeConfig(16, 16, 32, split_k=3))),
    (3, 4, 2, 32, 64, (MoeConfig(16, 32, 16, 4, 2), MoeConfig(16, 32, 16, 4, 2, split_k=2))),
])
def test_fused_moe_matches_reference(m: int, e: int, k: int, h: int, inter: int,
                                     configs: tuple[MoeConfig, MoeConfig] | None) -> None:
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) * 0.1
    w2 = torch.randn(e, h, inter, generator=g) * 0.1
    weights, ids = torch.softmax(torch.randn(m, e, generator=g), -1).topk(k)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, configs=configs),
                               fused_moe_ref(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-5)


def test_pick_config_shapes() -> None:
    # Qwen3-30B-A3B at batch 1: 16-row blocks; Mixtral's long-K down projection at batch 1 splits K
    assert pick_config(1, 8, 128, 1536, 2048, down=False).block_m == 16
    assert pick_config(1, 2, 8, 4096, 14336, down=True).split_k > 1
    assert pick_config(256, 8, 128, 1536, 2048, down=False).block_m == 32
    assert pick_config(1024, 8, 128, 1536, 2048, down=False).block_m == 64
    big = pick_config(1024, 2, 8, 4096, 14336, down=True)
    assert (big.block_m, big.split_k) == (128, 1)
    assert pick_config(1, 8, 128, 2048, 768, down=True).split_k == 1  # Qwen's 256 programs fill a wave


def test_fused_moe_empty_and_shape_errors() -> None:
    w13, w2 = torch.zeros(4, 32, 16), torch.zeros(4, 16, 16)
    out = fused_moe(torch.zeros(0, 16), w13, w2, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64))
    assert out.shape == (0, 16)
    with pytest.raises(ValueError, match="do not fit together"):
        fused_moe(torch.zeros(3, 16), w13, torch.zeros(4, 16, 8), torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.int64))
    ids = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="share block_m"):
        fused_moe(torch.zeros(3, 16), w13, w2, torch.zeros(3, 2), ids, configs=(MoeConfig(16, 16, 16), MoeConfig(64, 16, 16)))


def test_fused_moe_chunks_long_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past CHUNK_TOKENS the tokens go through in passes (bounded transient memory), with the same result."""
    import kernels.fused_moe as fm

    m, e, k, h, inter = 11, 4, 2, 32, 48
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) * 0.1
    w2 = torch.randn(e, h, inter, generator=g) * 0.1
    weights, ids = torch.softmax(torch.randn(m, e, generator=g), -1).topk(k)
    cfgs = (MoeConfig(16, 32, 16, 4, 2), MoeConfig(16, 32, 16, 4, 2))
    whole = fused_moe(x, w13, w2, weights, ids, configs=cfgs)
    passes: list[int] = []
    real_pass = fm._fused_moe_pass

    def counted(x_: torch.Tensor, *args: object) -> torch.Tensor:
        passes.append(x_.shape[0])
        return real_pass(x_, *args)

    monkeypatch.setattr(fm, "CHUNK_TOKENS", 4)
    monkeypatch.setattr(fm, "_fused_moe_pass", counted)
    # tokens are independent; not bitwise here only since the interpreter's tl.dot is a BLAS matmul whose
    # rounding varies with which rows share a block
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, configs=cfgs), whole, rtol=1e-6, atol=1e-7)
    assert passes == [4, 4, 3]
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids),
                               rtol=1e-4, atol=1e-5)  # pick_config's tiles per pass
    assert passes[3:] == [4, 4, 3]


def _fp8_experts(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A stack [E, N, K] quantized as MoeQuant lays it out (per channel, or per block with ragged edges)."""
    e, n, k = w.shape
    if block is None:
        scale = w.abs().amax(dim=2).clamp(min=1e-12) / 448.0
        return (w / scale[:, :, None]).to(torch.float8_e4m3fn), scale
    bn, bk = block
    nb, kb = -(-n // bn), k // bk
    padded = torch.zeros(e, nb * bn, k)
    padded[:, :n] = w
    scale = padded.view(e, nb, bn, kb, bk).abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0
    s = scale.repeat_interleave(bn, 1)[:, :n].repeat_interleave(bk, 2)
    return (w / s).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("block", [None, (16, 16), (64, 16)])  # per channel; blocks; N blocks ragged at the end
@pytest.mark.parametrize("m", [3, 40])  # 16-row blocks; 32-row blocks
def test_fp8_experts_match_reference(block: tuple[int, int] | None, m: int) -> None:
    from kernels.fused_moe import MoeQuant, dequantize_experts

    e, k, h, inter = 4, 2, 32, 48
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, h, generator=g)
    w13, s13 = _fp8_experts(torch.randn(e, 2 * inter, h, generator=g) * 0.1, block)
    w2, s2 = _fp8_experts(torch.randn(e, h, inter, generator=g) * 0.1, block)
    quant = MoeQuant(s13, s2, block)
    weights, ids = torch.softmax(torch.randn(m, e, generator=g), -1).topk(k)
    got = fused_moe(x, w13, w2, weights, ids, quant=quant)
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, weights, ids, quant=quant), rtol=1e-3, atol=1e-4)
    # and the quantized model stays near the one of its dequantized weights (inputs unrounded)
    plain = fused_moe_ref(x, dequantize_experts(w13, s13, block), dequantize_experts(w2, s2, block), weights, ids)
    assert (got - plain).abs().max() <= 0.1 * plain.abs().max()
