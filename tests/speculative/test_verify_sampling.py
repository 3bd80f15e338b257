"""VerifySampling: one sampling row per verify position, set up as the normal sampler would see that
output position, and the accepted run ends at the first draft the target disagrees with."""

from __future__ import annotations

import torch

from runtime.layers.sampler import Sampler
from runtime.messages import SamplingBatch, SpecInfo
from runtime.speculative.verify_sampling import VerifySampling


def batch(n: int, **over) -> SamplingBatch:
    base = dict(temperatures=[1.0] * n, top_ps=[1.0] * n, top_ks=[0] * n, min_ps=[0.0] * n,
                seeds=list(range(n)), steps=[5] * n, repetition_penalties=[1.0] * n,
                frequency_penalties=[0.0] * n, presence_penalties=[0.0] * n, penalty_tokens=[[] for _ in range(n)],
                prompt_lens=[3] * n, blocked_token_ids=[[] for _ in range(n)], top_logprobs_nums=[0] * n)
    return SamplingBatch(**{**base, **over})


def test_expand_rows_follow_the_output_position():
    sb = batch(2, steps=[5, 9], penalty_tokens=[[1, 2, 3], []], frequency_penalties=[0.5, 0.0],
               blocked_token_ids=[[7], [7]])
    spec = SpecInfo(num_drafts=[2, 0], min_new_left=[1, 3])
    rows = VerifySampling.expand(sb, spec, [[10, 11], []])
    assert rows.steps == [5, 6, 7, 9]
    assert rows.seeds == [0, 0, 0, 1]
    assert rows.penalty_tokens == [[1, 2, 3], [1, 2, 3, 10], [1, 2, 3, 10, 11], []]
    assert rows.frequency_penalties == [0.5, 0.5, 0.5, 0.0]
    assert rows.blocked_token_ids == [[7], [], [], [7]]  # min_new_tokens reached after one more token


def test_accept_stops_at_first_mismatch():
    # request 0: drafts 4 5 6, target rows 4 5 9 9 → accepts 4 5, then the target's 9
    # request 1: no drafts → the target's token; request 2: all accepted plus the bonus row
    targets = [4, 5, 9, 9, 8, 1, 2, 3]
    rows, counts = VerifySampling.accept(targets, [[4, 5, 6], [], [1, 2]])
    assert counts == [3, 1, 3]
    assert [targets[r] for r in rows] == [4, 5, 9, 8, 1, 2, 3]


def test_rows_sample_what_the_normal_sampler_samples():
    """Row j of a verify step draws the same token as a plain decode at output position step + j with the
    drafts as its earlier outputs: penalties and noise included."""
    torch.manual_seed(0)
    v = 50
    logits = torch.randn(3, v) * 3
    drafts = [[int(logits[0].argmax()), 17]]
    sb = batch(1, penalty_tokens=[[1, 2, 3]], repetition_penalties=[1.3], presence_penalties=[0.4], top_ks=[20])
    rows = VerifySampling.expand(sb, SpecInfo(num_drafts=[2]), drafts)
    joint = Sampler()(logits, rows).next_token_ids.tolist()
    for j in range(3):
        one = batch(1, steps=[5 + j], penalty_tokens=[[1, 2, 3] + drafts[0][:j]], repetition_penalties=[1.3],
                    presence_penalties=[0.4], top_ks=[20])
        assert Sampler()(logits[j:j + 1], one).next_token_ids.tolist() == [joint[j]]



def test_plain_greedy_only_when_the_sampler_would_just_take_the_argmax():
    spec = SpecInfo(num_drafts=[2, 1], min_new_left=[0, 0])
    assert VerifySampling.plain_greedy(batch(2, temperatures=[0.0, 0.0]), spec)
    assert not VerifySampling.plain_greedy(batch(2, temperatures=[0.0, 0.7]), spec)
    assert not VerifySampling.plain_greedy(batch(2, temperatures=[0.0, 0.0], return_logprob=True), spec)
    assert not VerifySampling.plain_greedy(batch(2, temperatures=[0.0, 0.0], penalty_tokens=[[1], []]), spec)
    assert not VerifySampling.plain_greedy(batch(2, temperatures=[0.0, 0.0], logit_biases=[[(3, 1.0)], []]), spec)
    # EOS blocked below min_new_tokens: only while a request still has rows to block
    blocked = batch(2, temperatures=[0.0, 0.0], blocked_token_ids=[[7], []])
    assert VerifySampling.plain_greedy(blocked, spec)
    assert not VerifySampling.plain_greedy(blocked, SpecInfo(num_drafts=[2, 1], min_new_left=[1, 0]))


def test_greedy_argmax_of_bf16_logits_equals_the_samplers_fp32_choice():
    # The verify graph leaves its logits in the model dtype; the greedy path takes their argmax directly.
    torch.manual_seed(0)
    logits = torch.randn(12, 300).to(torch.bfloat16)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: both take the first index
    sb = batch(12, temperatures=[0.0] * 12)
    assert torch.equal(logits.argmax(dim=-1), Sampler()(logits, sb).next_token_ids)
