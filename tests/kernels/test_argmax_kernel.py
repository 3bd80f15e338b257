"""kernels/argmax.py in the Triton interpreter: torch.argmax's index for every row (first index of the
maximum), including ties inside one chunk and across chunks, a partial last chunk, rows of -inf, 16-bit
logits and rows strided inside a wider tensor."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import BLOCK, argmax_rows, argmax_rows_ref, use_argmax_rows


@pytest.mark.parametrize("vocab", [BLOCK + 1, 3 * BLOCK - 17, 2 * BLOCK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows_match_torch(vocab: int, dtype: torch.dtype) -> None:
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    assert torch.equal(argmax_rows(logits), argmax_rows_ref(logits))


def test_ties_pick_the_first_index() -> None:
    vocab = 3 * BLOCK - 5
    logits = torch.zeros(4, vocab)
    logits[0, [BLOCK + 7, 2 * BLOCK + 1]] = 3.0  # tie across chunks: the earlier chunk's
    logits[1, [2 * BLOCK + 2, 2 * BLOCK + 3, vocab - 1]] = 1.0  # tie inside the partial last chunk
    logits[2, [5, BLOCK - 1, BLOCK]] = 2.0  # tie across a chunk boundary
    logits[3] = float("-inf")  # nothing allowed: torch gives 0
    got = argmax_rows(logits)
    assert got.tolist() == [BLOCK + 7, 2 * BLOCK + 2, 5, 0]
    assert torch.equal(got, argmax_rows_ref(logits))


def test_strided_rows_and_the_result_type() -> None:
    wide = torch.randn(3, 2 * BLOCK + 64, generator=torch.Generator().manual_seed(1))
    logits = wide[:, : 2 * BLOCK]  # each row's stride is the wider tensor's
    got = argmax_rows(logits)
    assert got.dtype == torch.int64 and got.shape == (3,)
    assert torch.equal(got, logits.argmax(dim=-1))


def test_nan_is_found_not_skipped() -> None:
    logits = torch.zeros(1, BLOCK + 10)
    logits[0, BLOCK + 3] = float("nan")
    assert argmax_rows(logits).tolist() == [BLOCK + 3]


def test_empty_and_bad_shapes() -> None:
    assert argmax_rows(torch.zeros(0, BLOCK + 1)).shape == (0,)
    with pytest.raises(ValueError, match="rows, vocab"):
        argmax_rows(torch.zeros(BLOCK + 1))
    with pytest.raises(ValueError, match="vocabulary of 0"):
        argmax_rows(torch.zeros(2, 0))


def test_dispatch_is_cuda_and_large_vocab_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not use_argmax_rows(torch.zeros(1, 4 * BLOCK))  # CPU keeps torch's
    if torch.cuda.is_available():
        assert use_argmax_rows(torch.zeros(1, 4 * BLOCK, device="cuda"))
        assert not use_argmax_rows(torch.zeros(1, BLOCK, device="cuda"))
        monkeypatch.setenv("SHOAL_FAST_ARGMAX", "0")
        assert not use_argmax_rows(torch.zeros(1, 4 * BLOCK, device="cuda"))


def test_chunk_topk_leaders_best_first() -> None:
    from kernels.argmax import _chunk_leaders, chunk_argmax

    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(3))
    logits[1, 256:] = float("-inf")  # the last chunk (44 columns) holds nothing allowed
    want = chunk_argmax(logits, 64, 4)  # torch's topk over the padded view (CPU path)
    vals, got = _chunk_leaders(logits, 64, 4)  # the kernel in the interpreter
    assert got.shape == want.shape == (2, 5 * 4)
    for r in range(2):
        for c in range(4):  # full chunks: the same four columns, best first
            assert got[r, 4 * c:4 * c + 4].tolist() == want[r, 4 * c:4 * c + 4].tolist()
            assert torch.equal(vals[r, 4 * c:4 * c + 4], logits[r, got[r, 4 * c:4 * c + 4].long()])
    assert got[0, 16:].tolist() == want[0, 16:].tolist()
    assert all(256 <= int(i) < 300 for i in got[1, 16:])  # -inf chunk: columns stay inside the row
