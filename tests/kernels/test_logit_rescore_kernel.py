"""kernels/logit_rescore.py in the Triton interpreter: the candidates' logits become hidden . weight rows
(fp32 accumulation), written in place; every other logit is left alone; the torch reference agrees."""

from __future__ import annotations

import torch

from kernels.logit_rescore import rescore_logits, rescore_logits_ref


def test_candidates_get_the_exact_dot_and_nothing_else_moves() -> None:
    gen = torch.Generator().manual_seed(0)
    rows, vocab, hidden = 3, 300, 1500  # hidden above one 1024-wide tile: the K loop runs twice, masked
    weight = torch.randn(vocab, hidden, generator=gen).to(torch.float16)
    x = torch.randn(rows, hidden, generator=gen).to(torch.float16)
    logits = torch.randn(rows, vocab, generator=gen)
    cand = torch.stack([torch.randperm(vocab, generator=gen)[:5] for _ in range(rows)])
    got, want = logits.clone(), logits.clone()
    rescore_logits(got, cand, x, weight)
    rescore_logits_ref(want, cand, x, weight, rows_at_once=2)
    exact = x.float() @ weight.float().t()
    torch.testing.assert_close(got.gather(1, cand), exact.gather(1, cand), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    untouched = torch.ones_like(logits, dtype=torch.bool).scatter_(1, cand, False)
    assert torch.equal(got[untouched], logits[untouched])


def test_no_rows_or_no_candidates_is_a_no_op() -> None:
    logits = torch.zeros(2, 10)
    rescore_logits(logits, torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 4), torch.zeros(10, 4))
    rescore_logits(logits[:0], torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, 4), torch.zeros(10, 4))
    assert not logits.any()
