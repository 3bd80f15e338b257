"""Sampler: greedy and filtered sampling, penalties, blocked ids, logprobs, and batch-independent seeding."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.layers.sampler import Sampler, greedy_ids, hash_uniform
from runtime.messages import SamplingBatch

VOCAB = 300


def _batch(n: int, **overrides: Any) -> SamplingBatch:
    base: dict[str, Any] = dict(
        temperatures=[1.0] * n, top_ps=[1.0] * n, top_ks=[-1] * n, min_ps=[0.0] * n, seeds=list(range(n)),
        steps=[0] * n, repetition_penalties=[1.0] * n, frequency_penalties=[0.0] * n,
        presence_penalties=[0.0] * n, penalty_tokens=[[] for _ in range(n)], prompt_lens=[0] * n,
        blocked_token_ids=[[] for _ in range(n)], top_logprobs_nums=[0] * n, return_logprob=False)
    base.update(overrides)
    return SamplingBatch(**base)


def _logits(n: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _draws(logits_row: torch.Tensor, n: int, **row: Any) -> torch.Tensor:
    """n draws from one distribution: n rows with distinct (seed, step) pairs."""
    settings = {k: [v] * n for k, v in row.items()}
    sb = _batch(n, seeds=[1000 + i // 4 for i in range(n)], steps=[i % 4 for i in range(n)], **settings)
    return Sampler()(logits_row.expand(n, -1).clone(), sb).next_token_ids


def test_seeded_sampling_independent_of_batch() -> None:
    sampler = Sampler()
    mine = dict(temperatures=0.8, top_ps=0.9, top_ks=50, min_ps=0.0, seeds=4242)
    others = [dict(temperatures=1.3, top_ps=1.0, top_ks=-1, min_ps=0.0, seeds=7),
              dict(temperatures=0.0, top_ps=1.0, top_ks=-1, min_ps=0.0, seeds=0),
              dict(temperatures=0.5, top_ps=0.5, top_ks=10, min_ps=0.1, seeds=99)]
    alone_tokens, batched_tokens = [], []
    for step in range(6):
        logits = _logits(4, seed=step, scale=1.0)
        alone = sampler(logits[1:2].clone(), _batch(1, steps=[step], **{k: [v] for k, v in mine.items()}))
        rows = [others[0], mine, *others[1:]]
        batched = sampler(logits.clone(), _batch(4, steps=[step] * 4, **{k: [r[k] for r in rows] for k in mine}))
        alone_tokens.append(int(alone.next_token_ids[0]))
        batched_tokens.append(int(batched.next_token_ids[1]))
        assert int(batched.next_token_ids[2]) == int(logits[2].argmax())  # the greedy neighbour
    assert alone_tokens == batched_tokens
    # It is sampling, not argmax in disguise: some step picks a token other than the argmax.
    assert any(t != int(_logits(4, seed=s, scale=1.0)[1].argmax()) for s, t in enumerate(alone_tokens))


def test_top_p_one_keeps_every_token_beside_a_truncating_batch_mate() -> None:
    """A batch mate's top_p < 1 sends the whole batch through the sorted cumsum, which in float32 passes 1.0
    in a large vocabulary's tail: a row with top_p 1 must keep that tail all the same (or its seeded draws
    would depend on its batch mates)."""
    logits = torch.randn(2, 32000, generator=torch.Generator().manual_seed(0)) * 3
    probs = torch.softmax(logits, dim=-1)
    sorted_p = probs[0].sort(descending=True).values
    assert ((sorted_p.cumsum(-1) - sorted_p) > 1.0).any()  # the overshoot this guards against is there
    kept = Sampler._filtered(probs, _batch(2, top_ps=[1.0, 0.5]))
    assert torch.equal(kept[0], probs[0])
    assert 0 < int((kept[1] > 0).sum()) < 32000


def test_seed_and_step_change_the_draw() -> None:
    row = torch.zeros(VOCAB)  # uniform: every draw is decided by the noise alone
    by_seed = Sampler()(row.expand(8, -1).clone(), _batch(8, seeds=list(range(8)))).next_token_ids
    by_step = Sampler()(row.expand(8, -1).clone(), _batch(8, seeds=[5] * 8, steps=list(range(8)))).next_token_ids
    assert len(set(by_seed.tolist())) > 4 and len(set(by_step.tolist())) > 4
    again = Sampler()(row.expand(8, -1).clone(), _batch(8, seeds=list(range(8)))).next_token_ids
    assert torch.equal(by_seed, again)


def test_hash_uniform_in_open_interval() -> None:
    u = hash_uniform(torch.tensor([0, 1, 2**62]), torch.tensor([0, 5, 10**6]), 4096)
    assert u.shape == (3, 4096) and bool((u > 0).all()) and bool((u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.02


def test_hash_uniform_extremes_stay_inside() -> None:
    """All hashed bits set or clear: still strictly inside (0, 1) in float32 (24 bits once rounded up to 1.0,
    so -log(u) was 0 and a zero-probability token won the draw as NaN)."""
    from runtime.layers.sampler import _unit

    u = _unit(torch.tensor([-1, 0, (1 << 63) - 1, -(1 << 63)], dtype=torch.int64))
    assert bool((u > 0).all()) and bool((u < 1).all()) and bool((-torch.log(u) > 0).all())


def test_hash_uniform_seeds_are_not_shifted_copies() -> None:
    """Choice j of a request samples with seed s + j: its noise row is no shift of choice 0's."""
    u = hash_uniform(torch.tensor([7, 8]), torch.tensor([3, 3]), 512)
    assert not torch.equal(u[1, :-1], u[0, 1:])
    assert abs(torch.corrcoef(torch.stack([u[1, :-1], u[0, 1:]]))[0, 1].item()) < 0.2


def test_masked_tokens_are_never_sampled() -> None:
    """top_k 2 over many seeds and steps: only the two top ids ever come out (a u of 1.0 once let NaN pick any)."""
    row = _logits(1, seed=9)[0]
    n = 4096
    out = Sampler()(row.expand(n, -1).clone(), _batch(n, seeds=list(range(n)), steps=[s % 97 for s in range(n)],
                                                     top_ks=[2] * n)).next_token_ids
    assert set(out.tolist()) <= set(row.topk(2).indices.tolist())


def test_greedy_is_argmax() -> None:
    logits = _logits(5, seed=3)
    out = Sampler()(logits.clone(), _batch(5, temperatures=[0.0] * 5))
    assert torch.equal(out.next_token_ids, logits.argmax(-1))


@pytest.mark.parametrize("setting", [dict(top_ks=1), dict(top_ps=1e-6), dict(min_ps=1.0)])
def test_degenerate_filters_equal_greedy(setting: dict[str, Any]) -> None:
    logits = _logits(6, seed=4)
    sb = _batch(6, **{k: [v] * 6 for k, v in setting.items()})
    assert torch.equal(Sampler()(logits.clone(), sb).next_token_ids, logits.argmax(-1))


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    row = torch.full((VOCAB,), -1e9)
    row[:6] = probs.log()
    assert set(_draws(row, 400, top_ks=3).tolist()) == {0, 1, 2}
    # top_p keeps the smallest prefix whose mass reaches p: 0.4 + 0.25 >= 0.6.
    assert set(_draws(row, 400, top_ps=0.6).tolist()) == {0, 1}
    # min_p keeps tokens with p >= min_p * p_max: 0.3 * 0.4 = 0.12.
    assert set(_draws(row, 400, min_ps=0.3).tolist()) == {0, 1, 2}


def test_temperature_one_matches_probabilities() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    row = torch.full((VOCAB,), -1e9)
    row[:4] = probs.log() + 3.0  # a shift changes nothing
    draws = _draws(row, 2000)
    freq = torch.bincount(draws, minlength=VOCAB)[:4].float() / 2000
    assert draws.max() < 4
    assert (freq - probs).abs().max() < 0.05, freq.tolist()
    # Temperature 2 flattens the distribution to softmax(logits / 2).
    hot = torch.bincount(_draws(row, 2000, temperatures=2.0), minlength=VOCAB)[:4].float() / 2000
    assert (hot - torch.softmax(probs.log() / 2, -1)).abs().max() < 0.05, hot.tolist()


def test_repetition_frequency_presence_penalties_match_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, -2.0, 1.0]])
    prompt, output = [1, 2], [2, 3, 3]
    sb = _batch(1, repetition_penalties=[1.5], frequency_penalties=[0.5], presence_penalties=[0.25],
                penalty_tokens=[prompt + output], prompt_lens=[len(prompt)])
    got = Sampler._apply_penalties(logits.clone(), sb)
    # Repetition (HF): every token seen in prompt or output, positive / 1.5, negative * 1.5.
    # Frequency/presence (OpenAI): generated tokens only, minus 0.5 * count + 0.25 if present.
    expected = torch.tensor([[2.0, -1.0 * 1.5, 3.0 / 1.5 - 0.5 * 1 - 0.25, 0.5 / 1.5 - 0.5 * 2 - 0.25, -2.0, 1.0]])
    torch.testing.assert_close(got, expected)


def test_penalties_change_the_greedy_choice_only_of_their_row() -> None:
    logits = torch.full((2, VOCAB), -10.0)
    logits[:, :3] = torch.tensor([1.0, 0.9, 0.0])
    sb = _batch(2, temperatures=[0.0, 0.0], presence_penalties=[0.2, 0.0], penalty_tokens=[[7, 0], [7, 0]],
                prompt_lens=[1, 1])
    assert Sampler()(logits.clone(), sb).next_token_ids.tolist() == [1, 0]
    sb = _batch(2, temperatures=[0.0, 0.0], repetition_penalties=[1.2, 1.0], penalty_tokens=[[0], [0]],
                prompt_lens=[1, 1])
    assert Sampler()(logits.clone(), sb).next_token_ids.tolist() == [1, 0]  # 1.0 / 1.2 < 0.9


def test_sampler_does_not_modify_callers_logits() -> None:
    logits = _logits(2, seed=8)
    before = logits.clone()
    sb = _batch(2, repetition_penalties=[2.0, 1.0], penalty_tokens=[[1, 2, 3], []], prompt_lens=[1, 0],
                blocked_token_ids=[[0], [5]])
    Sampler()(logits, sb)
    assert torch.equal(logits, before)


def test_blocked_token_ids_never_sampled() -> None:
    logits = _logits(1, seed=5)
    top3 = logits[0].topk(3).indices.tolist()
    greedy = Sampler()(logits.clone(), _batch(1, temperatures=[0.0], blocked_token_ids=[top3[:2]]))
    assert greedy.next_token_ids.tolist() == [top3[2]]
    row = torch.full((VOCAB,), -1e9)
    row[:3] = torch.tensor([5.0, 4.0, 0.0])
    draws = _draws(row, 300, blocked_token_ids=[0, 1])
    assert set(draws.tolist()) == {2}


def test_logprobs_and_top_logprobs_are_raw_log_softmax() -> None:
    logits = _logits(3, seed=6)
    raw = torch.log_softmax(logits, -1)
    sb = _batch(3, temperatures=[0.0, 0.7, 1.0], top_ks=[-1, 20, -1], repetition_penalties=[1.0, 1.0, 1.3],
                penalty_tokens=[[], [], [1, 2]], prompt_lens=[0, 0, 1], top_logprobs_nums=[3, 0, 5],
                return_logprob=True)
    out = Sampler()(logits.clone(), sb)
    ids = out.next_token_ids
    torch.testing.assert_close(out.logprobs, raw.gather(1, ids[:, None]).squeeze(1))
    assert out.top_logprobs is not None and [len(t) for t in out.top_logprobs] == [3, 0, 5]
    for i, n in ((0, 3), (2, 5)):
        vals, idx = raw[i].topk(n)
        assert [t for t, _ in out.top_logprobs[i]] == idx.tolist()
        assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(vals.tolist(), abs=1e-6)
    assert int(ids[0]) == int(logits[0].argmax())


def test_no_logprobs_unless_asked() -> None:
    out = Sampler()(_logits(2), _batch(2))
    assert out.logprobs is None and out.top_logprobs is None


def test_logit_bias_adds_to_its_row_only_and_keeps_raw_logprobs() -> None:
    logits = _logits(3, seed=11)
    raw = torch.log_softmax(logits, dim=-1)
    first = logits[0].argmax().item()
    low = logits[1].argmin().item()
    sb = _batch(3, temperatures=[0.0] * 3, logit_biases=[[(first, -100.0)], [(low, 100.0), (VOCAB + 5, 3.0)], []],
                return_logprob=True)
    before = logits.clone()
    out = Sampler()(logits, sb)
    ids = out.next_token_ids.tolist()
    assert ids[0] == logits[0].topk(2).indices[1].item()  # the greedy pick banned: the runner-up
    assert ids[1] == low  # +100 forces the least likely token (an out-of-vocab id is ignored)
    assert ids[2] == logits[2].argmax().item()
    assert torch.equal(logits, before)  # the caller's logits are untouched
    # Returned logprobs are those of the model's own distribution, as with penalties.
    assert torch.allclose(out.logprobs, raw.gather(1, out.next_token_ids[:, None]).squeeze(1))


def test_logit_bias_shifts_the_sampled_distribution() -> None:
    row = torch.zeros(VOCAB)
    draws = _draws(row, 400, logit_biases=[(7, 5.0)])  # e^5 / (e^5 + 299) ≈ 0.33 of the draws
    share = (draws == 7).float().mean().item()
    assert 0.25 < share < 0.42


@pytest.mark.parametrize(("overrides", "raw"), [
    ({}, True),
    ({"temperatures": [0.0, 0.7, 0.0]}, False),
    ({"return_logprob": True}, False),
    ({"penalty_tokens": [[], [5, 6], []], "repetition_penalties": [1.0, 1.2, 1.0]}, False),
    ({"blocked_token_ids": [[], [], [2]]}, False),
    ({"logit_biases": [[], [(3, 1.0)], []]}, False),
    ({"grammar_rows": [1], "grammar_mask": b"\xff" * 40}, False),
])
def test_raw_argmax_only_when_nothing_edits_or_asks(overrides: dict[str, Any], raw: bool) -> None:
    """A decode graph's greedy tail stands in for the Sampler only where the Sampler would return the argmax
    of the raw logits and nothing else: then the two give the same ids."""
    sb = _batch(3, **({"temperatures": [0.0] * 3} | overrides))
    assert sb.raw_argmax is raw
    if raw:
        logits = _logits(3, seed=4)
        assert torch.equal(Sampler()(logits, sb).next_token_ids, greedy_ids(logits))
