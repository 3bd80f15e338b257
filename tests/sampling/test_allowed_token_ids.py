"""allowed_token_ids in the Sampler: every row samples (greedy or seeded) only its allowed ids, a row
without any is untouched, the mask comes after the logit bias (a bias never lifts a masked id), bans that
would leave a row none of its allowed ids yield (the min_new_tokens EOS block first, the bad words only if
they alone still would), a grammar's mask intersects them, and logprobs stay the raw distribution's. Each
request packs its ids into a bitmask once (validation sorts and dedupes them); a step joins the masks,
and speculative verify repeats a request's mask per row. Validation: empty, negative and
out-of-vocabulary lists are InvalidRequestErrors naming the param, and the fields cross the Ray wire
(msgpack) unchanged."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from runtime.errors import InvalidRequestError
from runtime.layers.sampler import Sampler
from runtime.layers.token_bitmask import bitmask_from_bytes, unpack_bitmask
from runtime.managers.grammar_manager import GrammarManager
from runtime.managers.req import Req
from runtime.managers.request_validation import RequestLimits, validate_request
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.messages import GenerateRequest, SamplingBatch, SpecInfo
from runtime.model_executor.forward_mode import ForwardMode
from runtime.sampling.params import SamplingParams
from runtime.speculative.verify_sampling import VerifySampling

VOCAB = 300


def masks(allowed: list[list[int]]) -> dict[str, Any]:
    """allowed_rows / allowed_mask of rows limited to these ids ([]: any), as the scheduler packs them."""
    reqs = [Req(str(i), [1], SamplingParams(allowed_token_ids=a or None), 0, frozenset()) for i, a in enumerate(allowed)]
    sb = ScheduleBatch(ForwardMode.DECODE, reqs=reqs)._sampling()
    return {"allowed_rows": sb.allowed_rows, "allowed_mask": sb.allowed_mask}


def batch(n: int, allowed: list[list[int]] | None = None, **over: Any) -> SamplingBatch:
    base: dict[str, Any] = dict(
        temperatures=[1.0] * n, top_ps=[1.0] * n, top_ks=[-1] * n, min_ps=[0.0] * n, seeds=list(range(n)),
        steps=[0] * n, repetition_penalties=[1.0] * n, frequency_penalties=[0.0] * n,
        presence_penalties=[0.0] * n, penalty_tokens=[[] for _ in range(n)], prompt_lens=[0] * n,
        blocked_token_ids=[[] for _ in range(n)], top_logprobs_nums=[0] * n, **masks(allowed or [[]] * n))
    return SamplingBatch(**{**base, **over})


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_the_best_allowed_id_and_leaves_other_rows_alone():
    x = logits(3)
    allowed = [[5, 17, 250], [], [int(x[2].argmin()), 9]]
    out = Sampler()(x.clone(), batch(3, temperatures=[0.0] * 3, allowed=allowed)).next_token_ids.tolist()
    assert out[0] == max(allowed[0], key=lambda t: float(x[0, t]))
    assert out[1] == int(x[1].argmax())
    assert out[2] == max(allowed[2], key=lambda t: float(x[2, t]))


def test_seeded_draws_stay_in_the_allowed_set_and_follow_its_distribution():
    n = 2000
    row = logits(1, seed=1)[0]
    allowed = [3, 40, 41, 299]
    sb = batch(n, seeds=[7 + i // 8 for i in range(n)], steps=[i % 8 for i in range(n)],
               allowed=[allowed] * n, top_ks=[50] * n)
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
    sb = batch(1, temperatures=[0.0], allowed=[allowed], logit_biases=[[(best, 100.0)]],
               return_logprob=True, top_logprobs_nums=[2])
    out = Sampler()(x.clone(), sb)
    assert out.next_token_ids.tolist() == [other]  # +100 on a masked id does not bring it back
    raw = torch.log_softmax(x[0], dim=-1)
    assert out.logprobs.item() == pytest.approx(float(raw[other]))
    assert out.top_logprobs[0][0][0] == best  # the raw distribution's top, though it could not be sampled


@pytest.mark.parametrize(("allowed", "blocked", "words", "want"), [
    ([7, 11], [7], [], 11),  # the EOS block leaves 11: it holds
    ([7], [7], [], 7),  # it would leave nothing: only EOS allowed, EOS it is (the request may end early)
    ([7, 11], [7], [[11]], 7),  # both bans would: the EOS block yields first, the bad word stays banned
    ([7, 11], [], [[11], [7]], None),  # the bad words alone cover the set: they yield to allowed_token_ids
    ([7, 11], [7], [[11], [7]], None),  # EOS both blocked and a bad word: every ban yields
    ([], [7], [[11]], "free"),  # no allowed ids: the bans just hold
])
def test_bans_that_would_empty_a_row_yield_eos_block_first(allowed, blocked, words, want):
    x = logits(1, seed=3)
    x[0, 7], x[0, 11] = 50.0, 40.0  # EOS would win, then 11
    sb = batch(1, allowed=[allowed], temperatures=[0.0], blocked_token_ids=[blocked], bad_words_ids=[words],
               bad_words_context=[[]])
    got = Sampler()(x.clone(), sb).next_token_ids.tolist()[0]
    if want == "free":
        want = int(x[0].index_fill(0, torch.tensor([7, 11]), float("-inf")).argmax())
    assert got == (7 if want is None else want)


def test_bans_yield_per_row_in_one_batch():
    x = logits(3, seed=6)
    x[:, 7], x[:, 11] = 50.0, 40.0
    sb = batch(3, allowed=[[7, 11], [7, 11], [7, 11, 20]], temperatures=[0.0] * 3,
               blocked_token_ids=[[7], [7], [7]], bad_words_ids=[[], [[11]], [[11]]], bad_words_context=[[]] * 3)
    # Row 0: 11 is free, the block holds. Row 1: the block yields, the bad word holds. Row 2: 20 is free.
    assert Sampler()(x.clone(), sb).next_token_ids.tolist() == [11, 7, 20]


def test_a_grammar_mask_and_the_allowed_ids_intersect():
    x = logits(1, seed=5)
    grammar = [3, 8, 40, 77]  # the grammar allows these; allowed_token_ids only the last two and one more
    mask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    for t in grammar:
        mask[0, t // 32] |= 1 << (t % 32)
    sb = batch(1, temperatures=[0.0], allowed=[[40, 77, 150]], grammar_rows=[0],
               grammar_mask=mask.numpy().tobytes())
    assert Sampler()(x.clone(), sb).next_token_ids.tolist() == [max((40, 77), key=lambda t: float(x[0, t]))]


def test_the_callers_logits_stay_as_computed():
    x = logits(2, seed=4)
    before = x.clone()
    Sampler()(x, batch(2, temperatures=[0.0, 1.0], allowed=[[1, 2], [3]]))
    assert torch.equal(x, before)


def test_each_request_packs_its_mask_once_and_a_step_only_joins_them():
    params = SamplingParams.from_dict({"allowed_token_ids": [299, 3, 3, 40, 0]})
    assert params.allowed_token_ids == [0, 3, 40, 299]  # sorted and unique from validation on
    big = Req("b", [1], SamplingParams.from_dict({"allowed_token_ids": list(range(0, 100_000, 3))}), 0, frozenset())
    small = Req("s", [1], params, 0, frozenset())
    free = Req("f", [1], SamplingParams(), 0, frozenset())
    assert big.allowed_mask() is big.allowed_mask()  # built once
    sb = ScheduleBatch(ForwardMode.DECODE, reqs=[free, small, big])._sampling()
    # One width for the batch (the widest request's), 12.5 KB a row for 100k ids, not the id lists.
    assert sb.allowed_rows == [1, 2] and len(sb.allowed_mask) == 2 * 4 * (99_999 // 32 + 1)
    bits = unpack_bitmask(bitmask_from_bytes(sb.allowed_mask, 2, torch.device("cpu")), 100_001)
    assert bits[0].nonzero().flatten().tolist() == [0, 3, 40, 299]
    assert bits[1].nonzero().flatten().tolist() == list(range(0, 100_000, 3))
    x = torch.randn(3, 100_001)
    got = Sampler()(x.clone(), SamplingBatch(**{**msgspec.structs.asdict(sb), "temperatures": [0.0] * 3}))
    assert got.next_token_ids.tolist() == [int(x[0].argmax()), max([0, 3, 40, 299], key=lambda t: float(x[1, t])),
                                           3 * int(x[2, ::3][:33_334].argmax())]


def test_speculative_verify_rows_keep_their_requests_masks():
    x = logits(5, seed=8)
    sb = batch(2, allowed=[[4, 9, 260], []], temperatures=[0.0, 0.0], steps=[2, 5])
    spec = SpecInfo(num_drafts=[2, 1])
    assert not VerifySampling.plain_greedy(sb, spec)
    rows = VerifySampling.expand(sb, spec, [[9, 4], [7]])
    assert rows.allowed_rows == [0, 1, 2]
    want = [max((4, 9, 260), key=lambda t: float(x[j, t])) for j in range(3)] + [int(x[3].argmax()),
                                                                                   int(x[4].argmax())]
    assert Sampler()(x.clone(), rows).next_token_ids.tolist() == want


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
    sb = batch(2, allowed=[[3], []], bad_words_ids=[[[5, 6]], []], bad_words_context=[[5], []])
    assert msgspec.msgpack.Decoder(SamplingBatch).decode(msgspec.msgpack.encode(sb)) == sb


class Matcher:
    """A grammar matcher stub: accepts the ids in `ok`."""

    def __init__(self, ok: set[int]):
        self.ok = ok

    def accept_token(self, token: int) -> bool:
        return token in self.ok

    def is_terminated(self) -> bool:
        return False


@pytest.mark.parametrize(("params", "token", "param"), [
    ({"allowed_token_ids": [5]}, 0, "allowed_token_ids"),  # the grammar would take 0, the allowed ids not
    ({"allowed_token_ids": [5]}, 5, None),  # both take it: no error
    ({"allowed_token_ids": [5], "bad_words_ids": [[5]]}, 9, "allowed_token_ids"),
    ({"bad_words_ids": [[0]]}, 9, "bad_words"),  # the grammar refuses 9: the row had nothing left
    ({"bad_words_ids": [[0]]}, 0, "bad_words"),  # all -inf row's argmax on a banned id the grammar takes
    ({"bad_words_ids": [[7, 0]]}, 0, "bad_words"),  # after the output's 7: the word is complete
    ({"bad_words_ids": [[8, 0]]}, 0, None),  # after 7: not that word, no conflict
    ({"allowed_token_ids": [0], "bad_words_ids": [[0]]}, 0, None),  # the bans gave way to allowed ids
    ({}, 9, "none"),  # no such params: the engine's own failure, as before
])
def test_a_grammar_conflict_ends_the_request_naming_the_param(params, token, param):
    req = Req("r", [1], SamplingParams.from_dict({**params, "regex": "x"}), 0, frozenset())
    req.grammar = Matcher({0, 5})
    req.output_ids += [7, token]  # as token intake appends before accepting
    GrammarManager.accept(req, token)
    fr = req.finish_reason
    if param is None:
        assert fr is None
    elif param == "none":
        assert fr.kind == "error" and fr.param is None and "rejected sampled token 9" in fr.message
    else:
        assert fr.kind == "error" and fr.param == param and "no token satisfies" in fr.message
