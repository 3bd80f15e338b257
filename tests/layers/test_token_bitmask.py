"""apply_token_bitmask (the batch's grammar mask on the logits) against xgrammar's own reference, and
the Sampler applying a SamplingBatch's mask bytes to only the rows they name."""

from __future__ import annotations

import pytest
import torch

from runtime.layers.sampler import Sampler
from runtime.layers.token_bitmask import apply_token_bitmask, unpack_bitmask
from runtime.messages import SamplingBatch

xgr = pytest.importorskip("xgrammar")


@pytest.mark.parametrize("vocab", [31, 32, 1000, 4099])
def test_matches_xgrammar_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    rows = [0, 3, 5]
    words = (vocab + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), dtype=torch.int32, generator=g)
    ours = logits.clone()
    apply_token_bitmask(ours, mask, torch.tensor(rows))
    full = torch.full((6, words), -1, dtype=torch.int32)  # all allowed on the rows we leave free
    full[rows] = mask
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, full, backend="torch_native")
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.equal(ours, ref)


def test_padded_logits_columns_are_never_allowed():
    mask = torch.full((1, 1), -1, dtype=torch.int32)  # 32 tokens allowed
    allowed = unpack_bitmask(mask, 40)
    assert allowed[0, :32].all() and not allowed[0, 32:].any()


def _batch(n: int, rows: list[int], mask: torch.Tensor, temperature: float) -> SamplingBatch:
    return SamplingBatch(temperatures=[temperature] * n, top_ps=[1.0] * n, top_ks=[-1] * n, min_ps=[0.0] * n,
                         seeds=list(range(n)), steps=[0] * n, repetition_penalties=[1.0] * n,
                         frequency_penalties=[0.0] * n, presence_penalties=[0.0] * n, penalty_tokens=[[]] * n,
                         prompt_lens=[0] * n, blocked_token_ids=[[]] * n, top_logprobs_nums=[0] * n,
                         logit_biases=[[(5, 100.0)]] * n,  # the bias must not revive a masked token
                         grammar_rows=rows, grammar_mask=mask.numpy().tobytes())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_masks_only_constrained_rows(temperature):
    vocab, n = 100, 4
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1))
    allowed = [7, 42, 99]
    mask = torch.zeros(2, (vocab + 31) // 32, dtype=torch.int32)
    for t in allowed:
        mask[:, t // 32] |= 1 << (t % 32)
    for _ in range(3):
        ids = Sampler()(logits, _batch(n, [1, 3], mask, temperature)).next_token_ids.tolist()
        assert ids[1] in allowed and ids[3] in allowed
        assert ids[0] == 5 and ids[2] == 5  # free rows: the +100 bias wins
