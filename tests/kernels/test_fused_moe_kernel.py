"""kernels/fused_moe: the sorted, padded expert layout (moe_align) and the grouped-GEMM MoE against its torch
reference, in the Triton interpreter on CPU (fp32: the interpreter's bf16 tl.dot is wrong)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import fused_moe, fused_moe_ref, moe_align


def test_moe_align_groups_pads_and_bounds() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 3]])
    sorted_ids, expert_ids, total = moe_align(ids, num_experts=5, block_m=4)
    n = ids.numel()
    assert sorted_ids.numel() == 24  # the bound 8 + 5 * 3 = 23, rounded up to whole 4-row blocks
    assert int(total) == 16  # experts 0, 1, 2, 3 each one 4-row block (expert 2 has 4 rows exactly)
    blocks = sorted_ids[: int(total)].view(-1, 4)
    flat = ids.reshape(-1)
    for b, row in enumerate(blocks):
        real = row[row < n]
        assert (flat[real] == expert_ids[b]).all()  # each block holds only its expert's pairs
    got = sorted(sorted_ids[sorted_ids < n].tolist())
    assert got == list(range(n))  # every (token, slot) pair exactly once
    # the layout's size depends only on M, k and E, not on the routing (fixed shapes for CUDA graphs)
    other = moe_align(torch.zeros_like(ids), num_experts=5, block_m=4)
    assert other[0].shape == sorted_ids.shape and other[1].shape == expert_ids.shape


@pytest.mark.parametrize(("m", "e", "k", "h", "inter"), [
    (1, 8, 2, 40, 24),      # decode: one token, sizes not multiples of the tiles
    (6, 4, 2, 32, 48),
    (37, 16, 3, 64, 80),    # more pairs than one block per expert; some experts unused
])
def test_fused_moe_matches_reference(m: int, e: int, k: int, h: int, inter: int) -> None:
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) * 0.1
    w2 = torch.randn(e, h, inter, generator=g) * 0.1
    weights, ids = torch.softmax(torch.randn(m, e, generator=g), -1).topk(k)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids),
                               rtol=1e-4, atol=1e-5)


def test_fused_moe_empty_and_shape_errors() -> None:
    w13, w2 = torch.zeros(4, 32, 16), torch.zeros(4, 16, 16)
    out = fused_moe(torch.zeros(0, 16), w13, w2, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64))
    assert out.shape == (0, 16)
    with pytest.raises(ValueError, match="do not fit together"):
        fused_moe(torch.zeros(3, 16), w13, torch.zeros(4, 16, 8), torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.int64))
