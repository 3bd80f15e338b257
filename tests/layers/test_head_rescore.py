"""runtime/layers/head_rescore.py and kernels/argmax.chunk_argmax: an FP8 head's swapped leaders come back.

The FP8 logits are stood in for by the exact ones plus noise that puts a wrong column on top (in another
chunk than the true leader): after rescoring, every chunk's leader holds its exact value and the row's
argmax is the exact one. Also the candidate count and chunk_argmax's indices against a brute force."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import chunk_argmax
from runtime.layers.head_rescore import candidate_block, rescore_chunk_leaders


@pytest.mark.parametrize("block", [16, 64, 1024])
def test_chunk_argmax_is_each_chunks_first_leader(block: int) -> None:
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(block))
    logits[1, 3] = logits[1, 7] = 50.0  # a tie inside the first chunk: the earlier column
    logits[2] = float("-inf")
    got = chunk_argmax(logits, block)
    chunks = -(-1000 // block)
    assert got.shape == (3, chunks) and got.dtype == torch.int64
    for r in range(3):
        for c in range(chunks):
            part = logits[r, c * block:(c + 1) * block]
            assert int(got[r, c]) == c * block + int(part.argmax())
    assert int(got[1, 0]) == 3


def test_chunk_argmax_rejects_a_block_that_is_not_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        chunk_argmax(torch.zeros(1, 10), 12)


def test_swapped_leaders_are_restored() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, hidden = 5000, 64
    weight = torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16)
    x = torch.randn(4, hidden, generator=gen).to(torch.bfloat16)
    exact = (x.float() @ weight.float().t())
    true = exact.argmax(dim=-1)
    noisy = exact + 0.01 * torch.randn(exact.shape, generator=gen)
    wrong = (true + vocab // 2) % vocab  # far from the true leader: another chunk whatever the block
    noisy[torch.arange(4), wrong] = exact[torch.arange(4), true] + 1.0  # the "FP8" row puts it on top
    noisy[torch.arange(4), true] -= 0.5
    got = rescore_chunk_leaders(noisy.clone(), x, weight)
    assert torch.equal(got.argmax(dim=-1), true)
    # Every chunk leader the noisy logits had now holds (to bf16 rounding) its exact logit.
    block = candidate_block(vocab)
    cand = chunk_argmax(noisy, block)
    torch.testing.assert_close(got.gather(1, cand), exact.gather(1, cand), rtol=1e-2, atol=1e-2)


def test_candidate_count() -> None:
    # Llama-3's 128,256 columns: chunks of 2048, 63 candidates a row; SmolLM2's 49,152: 1024, 48.
    assert candidate_block(128256) == 2048 and -(-128256 // 2048) == 63
    assert candidate_block(49152) == 1024
    assert candidate_block(100) == 16


def test_bad_shapes_raise_and_empty_passes() -> None:
    with pytest.raises(ValueError, match="do not pair"):
        rescore_chunk_leaders(torch.zeros(2, 10), torch.zeros(3, 4), torch.zeros(10, 4))
    empty = torch.zeros(0, 10)
    assert rescore_chunk_leaders(empty, torch.zeros(0, 4), torch.zeros(10, 4)) is empty
