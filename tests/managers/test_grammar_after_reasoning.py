"""Reasoning-aware structured output in the scheduler (SamplingParams.grammar_after_token): the grammar
neither masks nor advances nor ends a request until it samples the think-end token, then constrains
every token after it. Seeded sampling is a pure function of (seed, position, token), so a request whose
grammar waits samples, up to and with </think>, exactly the tokens of the same request without a grammar;
a logit_bias on </think> makes the random model close its reasoning after a few tokens. Also: a batch
mixing waiting, active and free requests under the plain loop, overlap scheduling and retraction (KV
invariant checked every step, pool full at the end), reasoning that never ends (finish "length"), a
failover resume past </think>, and the field's validation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tiny_think_model import make_think_model

from runtime import Engine
from runtime.errors import InvalidRequestError
from runtime.managers.grammar_manager import GrammarManager
from runtime.managers.req import Req
from runtime.managers.request_validation import RequestLimits, validate_request
from runtime.messages import GenerateRequest
from runtime.sampling.params import SamplingParams

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
          "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def think_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_think_model(tmp_path_factory.mktemp("think") / "model")


def _end(e: Engine) -> int:
    (end,) = e.tokenizer.encode("</think>", add_special_tokens=False)
    return end


def _free(end: int, seed: int, bias: float = 4.0, n: int = 30) -> dict[str, Any]:
    return {"temperature": 1.0, "seed": seed, "logit_bias": {end: bias}, "max_new_tokens": n}


def _waiting(end: int, seed: int, **kw: Any) -> dict[str, Any]:
    return {**_free(end, seed, n=60, **kw), "json_schema": json.dumps(SCHEMA), "grammar_after_token": end}


def _closing_seeds(e: Engine, ids: list[int], count: int) -> list[tuple[int, int]]:
    """(seed, k): seeds whose free run samples </think> at position k >= 3 (k free tokens first)."""
    end, found = _end(e), []
    for seed in range(200):
        out = e.generate(input_ids=ids, sampling_params=_free(end, seed))["output_ids"]
        if end in out and out.index(end) >= 3:
            found.append((seed, out.index(end)))
            if len(found) == count:
                return found
    raise AssertionError("no seed closes the reasoning after a few tokens")


def _check_answer(e: Engine, out: dict[str, Any], free: list[int], k: int) -> None:
    """The first k + 1 tokens are the free run's; after </think> a JSON object for SCHEMA."""
    ids = out["output_ids"]
    assert ids[:k + 1] == free[:k + 1]
    jsonschema.validate(json.loads(e.tokenizer.decode(ids[k + 1:])), SCHEMA)
    assert out["finish_reason"] == "stop"


@pytest.mark.parametrize("overlap", [False, True])
def test_grammar_waits_for_think_end(make_engine, think_model, overlap):
    e = make_engine(think_model)
    e.scheduler.overlap = overlap
    ids, end = e.tokenizer.apply_chat_template(MESSAGES), _end(e)
    (seed, k), = _closing_seeds(e, ids, 1)
    free = e.generate(input_ids=ids, sampling_params=_free(end, seed))["output_ids"]
    out = e.generate(input_ids=ids, sampling_params=_waiting(end, seed))
    _check_answer(e, out, free, k)
    # The free tokens are ones the grammar refuses: from the first token it writes the JSON at once.
    first = e.generate(input_ids=ids, sampling_params={**_waiting(end, seed), "grammar_after_token": None})
    assert e.tokenizer.decode(first["output_ids"]).startswith("{") and free[0] != first["output_ids"][0]
    jsonschema.validate(json.loads(first["text"]), SCHEMA)


def test_reasoning_that_never_ends_finishes_with_length(make_engine, think_model, pool_full):
    e = make_engine(think_model)
    ids, end = e.tokenizer.apply_chat_template(MESSAGES), _end(e)
    out = e.generate(input_ids=ids, sampling_params={**_waiting(end, 0, bias=-100.0), "max_new_tokens": 12,
                                                     "ignore_eos": True})
    assert out["finish_reason"] == "length" and len(out["output_ids"]) == 12 and end not in out["output_ids"]
    pool_full(e)


@pytest.mark.parametrize("kw, overlap", [
    ({}, False),
    ({}, True),
    ({"chunked_prefill_size": 8, "enable_mixed_chunk": True}, True),
    # Retraction (a low output estimate over-admits): a retracted request keeps its matcher and its wait.
    ({"max_total_tokens": 90, "init_new_token_ratio": 0.05, "min_new_token_ratio": 0.05}, True),
])
def test_mixed_batch(make_engine, think_model, kw, overlap):
    """Waiting, active (grammar from the start), never-ending and free requests in one batch: each gets its
    solo output, and the KV invariant holds after every step."""
    e = make_engine(think_model, **kw)
    ids, end = e.tokenizer.apply_chat_template(MESSAGES), _end(e)
    seeds = _closing_seeds(e, ids, 3)
    e.scheduler.overlap = overlap
    params = [_waiting(end, s) for s, _ in seeds]
    params += [{**_waiting(end, 7), "grammar_after_token": None},
               {**_waiting(end, 8, bias=-100.0), "max_new_tokens": 25, "ignore_eos": True},
               _free(end, 9)]
    solo = [e.generate(input_ids=ids, sampling_params=p) for p in params]
    errors = _check_every_step(e)
    outs = e.generate(input_ids=[ids] * len(params), sampling_params=params)
    assert not errors, errors[:3]
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in solo]
    assert [o["finish_reason"] for o in outs] == ["stop"] * 4 + ["length", "length"]
    for o, (seed, k) in zip(outs, seeds):
        _check_answer(e, o, e.generate(input_ids=ids, sampling_params=_free(end, seed))["output_ids"], k)
    if "max_total_tokens" in kw:
        assert e.get_stats().retractions > 0


def _check_every_step(e: Engine) -> list[str]:
    s, real_step, errors = e.scheduler, e.scheduler.step, []

    def step() -> bool:
        did = real_step()
        with s.lock:
            try:
                s.check_kv_invariant()
            except AssertionError as err:
                errors.append(str(err))
        return did

    s.step = step
    return errors


def test_failover_resume_past_think_end(make_engine, think_model):
    """A request resumed with tokens another replica sampled (</think> among them) continues under the
    grammar: the matcher catches up on the resumed tokens, so the answer is the uninterrupted one."""
    e = make_engine(think_model)
    ids, end = e.tokenizer.apply_chat_template(MESSAGES), _end(e)
    (seed, k), = _closing_seeds(e, ids, 1)
    whole = e.generate(input_ids=ids, sampling_params=_waiting(end, seed))["output_ids"]
    for cut in (k - 1, k + 1, k + 3):  # still reasoning; just past </think>; inside the JSON
        resumed = list(whole[:cut])
        req = GenerateRequest(rid=f"resumed-{cut}", input_ids=ids, resumed_output_ids=resumed,
                              sampling_params=SamplingParams.from_dict(_waiting(end, seed)))
        assert _run_request(e, req) == whole[cut:], cut


def _run_request(e: Engine, req: GenerateRequest) -> list[int]:
    """The tokens a raw GenerateRequest produces past its resumed ones."""
    import asyncio

    async def go() -> list[int]:
        got: list[int] = []
        async for out in e.stream(req):
            got += out.new_token_ids
        return got

    return asyncio.run(go())


class _Matcher:
    """Stands in for xgrammar's matcher: records what the grammar was shown."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def accept_token(self, token: int) -> bool:
        self.seen.append(token)
        return True

    def is_terminated(self) -> bool:
        return len(self.seen) >= 2


class _Compiler:
    def fill_bitmask(self, matchers: list[Any], mask: Any) -> None:
        mask.fill_(-1)


def test_grammar_manager_gates_on_the_token():
    gm = GrammarManager(_Compiler(), vocab_size=64)  # type: ignore[arg-type]
    params = SamplingParams(json_schema="{}", grammar_after_token=9)
    waiting, active = (Req(rid, [1, 2], p, 0, frozenset({3})) for rid, p in
                       (("w", params), ("a", SamplingParams(json_schema="{}"))))
    for r in (waiting, active):
        r.grammar = _Matcher()
    assert gm.bitmask([waiting, active], [True, True])[0] == [1]
    for t in (5, 3, 6):  # free tokens, the grammar's stop token among them: nothing ends, nothing masks
        gm.accept(waiting, t)
    assert waiting.grammar.seen == [] and not waiting.finished and waiting.grammar_wait == 9
    gm.accept(waiting, 9)  # </think>: not shown to the grammar; the next token is constrained
    assert waiting.grammar.seen == [] and waiting.grammar_active
    assert gm.bitmask([waiting, active], [True, True])[0] == [0, 1]
    gm.accept(waiting, 11)
    gm.accept(waiting, 12)
    assert waiting.grammar.seen == [11, 12] and waiting.finish_reason.kind == "stop"


@pytest.mark.parametrize("params, param", [
    ({"grammar_after_token": 5}, "grammar_after_token"),  # no grammar to gate
    ({"regex": "a+", "grammar_after_token": -1}, "grammar_after_token"),
    ({"regex": "a+", "grammar_after_token": True}, "grammar_after_token"),
])
def test_bad_grammar_after_token(params, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.from_dict(params)
    assert err.value.param == param


def test_grammar_after_token_outside_the_vocabulary():
    limits = RequestLimits(context_len=64, vocab_size=100, kv_size=1000)
    ok = GenerateRequest(rid="a", input_ids=[1, 2], sampling_params=SamplingParams(regex="a+", grammar_after_token=99))
    validate_request(limits, ok)
    bad = GenerateRequest(rid="b", input_ids=[1, 2], sampling_params=SamplingParams(regex="a+", grammar_after_token=100))
    with pytest.raises(InvalidRequestError) as err:
        validate_request(limits, bad)
    assert err.value.param == "grammar_after_token"
