"""allowed_token_ids in the Sampler: every row samples (greedy or seeded) only its allowed ids, a row
without any is untouched, the mask comes after the logit bias (a bias never lifts a masked id), a ban
that would leave a row none of its allowed ids yields to them, a grammar's mask intersects them, and
logprobs stay the raw distribution's. Validation: empty, negative and out-of-vocabulary lists are
InvalidRequestErrors naming the param, and the field crosses the Ray wire (msgpack) unchanged."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from runtime.errors import InvalidRequestError
from runtime.layers.sampler import Sampler
from runtime.managers.request_validation import RequestLimits, validate_request
from runtime.messages import GenerateRequest, SamplingBatch
from runtime.sampling.params import SamplingParams

VOCAB = 300


def batch(n: int, **over: Any) -> SamplingBatch:
    base: dict[str, Any] = dict(
        temperatures=[1.0] * n, top_ps=[1.0] * n, top_ks=[-1] * n, min_ps=[0.0] * n, seeds=list(range(n)),
        steps=[0] * n, repetition_penalties=[1.0] * n, frequency_penalties=[0.0] * n,
        presence_penalties=[0.0] * n, penalty_tokens=[[] for _ in range(n)], prompt_lens=[0] * n,
        blocked_token_ids=[[] for _ in range(n)], top_logprobs_nums=[0] * n)
    return SamplingBatch(**{**base, **over})


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_the_best_allowed_id_and_leaves_other_rows_alone():
    x = logits(3)
    allowed = [[5, 17, 250], [], [int(x[2].argmin()), 9]]
    out = Sampler()(x.clone(), batch(3, temperatures=[0.0] * 3, allowed_token_ids=allowed)).next_token_ids.tolist()
    assert out[0] == max(allowed[0], key=lambda t: float(x[0, t]))
    assert out[1] == int(x[1].argmax())
    assert out[2] == max(allowed[2], key=lambda t: float(x[2, t]))


def test_seeded_draws_stay_in_the_allowed_set_and_follow_its_distribution():
    n = 2000
    row = logits(1, seed=1)[0]
    allowed = [3, 40, 41, 299]
    sb = batch(n, seeds=[7 + i // 8 for i in range(n)], steps=[i % 8 for i in range(n)],
               allowed_token_ids=[allowed] * n, top_ks=[50] * n)
    ids = Sampler()(row.expand(n, -1).clone(), sb).next_token_ids
    assert set(ids.tolist()) <= set(allowed)
    want = torch.softmax(row[allowed], dim=0)  # top_k 50 keeps all four: they are the only finite ones
    got = torch.tensor([(ids == t).float().mean() for t in allowed])
    assert torch.allclose(got, want, atol=0.04), (got, want)


def test_mask_comes_after_the_bias_and_logprobs_stay_raw():
    x = logits(1, seed=2)
    best = int(x[0].argmax())
    allowed = [(best + 1) % VOCAB, (best + 2) % VOCAB]
    other = max(allowed, key=lambda t: float(x[0, t]))
    sb = batch(1, temperatures=[0.0], allowed_token_ids=[allowed], logit_biases=[[(best, 100.0)]],
               return_logprob=True, top_logprobs_nums=[2])
    out = Sampler()(x.clone(), sb)
    assert out.next_token_ids.tolist() == [other]  # +100 on a masked id does not bring it back
    raw = torch.log_softmax(x[0], dim=-1)
    assert out.logprobs.item() == pytest.approx(float(raw[other]))
    assert out.top_logprobs[0][0][0] == best  # the raw distribution's top, though it could not be sampled


def test_a_ban_covering_every_allowed_id_yields_to_them():
    x = logits(2, seed=3)
    eos = 7
    # Row 0: only EOS allowed while min_new_tokens blocks it: EOS it is (not an id outside the set).
    # Row 1: the ban covers one of two allowed ids: it holds.
    sb = batch(2, temperatures=[0.0, 0.0], allowed_token_ids=[[eos], [eos, 11]], blocked_token_ids=[[eos], [eos]])
    assert Sampler()(x.clone(), sb).next_token_ids.tolist() == [eos, 11]


def test_a_grammar_mask_and_the_allowed_ids_intersect():
    x = logits(1, seed=5)
    grammar = [3, 8, 40, 77]  # the grammar allows these; allowed_token_ids only the last two and one more
    mask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    for t in grammar:
        mask[0, t // 32] |= 1 << (t % 32)
    sb = batch(1, temperatures=[0.0], allowed_token_ids=[[40, 77, 150]], grammar_rows=[0],
               grammar_mask=mask.numpy().tobytes())
    assert Sampler()(x.clone(), sb).next_token_ids.tolist() == [max((40, 77), key=lambda t: float(x[0, t]))]


def test_the_callers_logits_stay_as_computed():
    x = logits(2, seed=4)
    before = x.clone()
    Sampler()(x, batch(2, temperatures=[0.0, 1.0], allowed_token_ids=[[1, 2], [3]]))
    assert torch.equal(x, before)


@pytest.mark.parametrize(("value", "words"), [
    ([], "must not be empty"),
    ([1, -1], "each of allowed_token_ids"),
    ([1, 2.5], "allowed_token_ids"),
    ([True], "allowed_token_ids"),
])
def test_bad_values_name_the_param(value, words):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict({"allowed_token_ids": value})
    assert e.value.param == "allowed_token_ids" and words in e.value.message


def test_ids_outside_the_vocabulary_are_refused_before_the_scheduler():
    limits = RequestLimits(context_len=64, vocab_size=100, kv_size=64)
    ok = GenerateRequest(rid="a", input_ids=[1, 2], sampling_params=SamplingParams(allowed_token_ids=[0, 99]))
    assert validate_request(limits, ok).sampling_params.allowed_token_ids == [0, 99]
    bad = GenerateRequest(rid="b", input_ids=[1, 2], sampling_params=SamplingParams(allowed_token_ids=[5, 100]))
    with pytest.raises(InvalidRequestError) as e:
        validate_request(limits, bad)
    assert e.value.param == "allowed_token_ids" and "100" in e.value.message


def test_the_ray_wire_carries_the_new_fields():
    req = GenerateRequest(rid="a", input_ids=[1, 2], sampling_params=SamplingParams(
        allowed_token_ids=[3, 4], bad_words_ids=[[5, 6], [7]]))
    assert msgspec.msgpack.Decoder(GenerateRequest).decode(msgspec.msgpack.encode(req)) == req
    sb = batch(2, allowed_token_ids=[[3], []], bad_words_ids=[[[5, 6]], []], bad_words_context=[[5], []])
    assert msgspec.msgpack.Decoder(SamplingBatch).decode(msgspec.msgpack.encode(sb)) == sb
