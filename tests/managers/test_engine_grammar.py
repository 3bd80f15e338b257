"""Structured output in the in-process Engine: constrained greedy decoding equals HF transformers'
logits under xgrammar's own mask, token for token, while unconstrained requests in the same batch
still equal plain HF greedy — with the plain loop, overlap scheduling, chunked prefill, MIXED batches
and retraction; a bad or slow grammar is an InvalidRequestError naming its field (and fails alone in
the scheduler when a caller skips the check); aborts and 64 mixed requests leave the KV pool full."""

from __future__ import annotations

import json
import random
import re
import time
from typing import Any

import jsonschema
import pytest
import torch
from structured_schemas import SCHEMAS

from runtime.errors import InvalidRequestError
from runtime.messages import GenerateRequest
from runtime.sampling.params import SamplingParams

xgr = pytest.importorskip("xgrammar")

REGEX = r"[A-Z][a-z]{1,6} (is|was) [0-9]{1,3}"


@pytest.fixture(scope="module")
def hf_constrained(hf_llama, tiny_llama):
    """Greedy decoding by HF with xgrammar's mask applied to its logits (xgrammar's own reference op)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    vocab = hf_llama.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info)

    @torch.inference_mode()
    def run(prompt: list[int], kind: str, text: str, n: int) -> list[int]:
        if kind == "json_schema":  # what Shoal compiles (compact JSON, no control characters in strings)
            from runtime.sampling.grammar_compiler import _no_control_chars

            g = compiler.compile_grammar(_no_control_chars(str(xgr.Grammar.from_json_schema(text, any_whitespace=False))))
        else:
            g = compiler.compile_regex(text)
        m = xgr.GrammarMatcher(g)
        mask = xgr.allocate_token_bitmask(1, vocab)
        ids: list[int] = []
        for _ in range(n):
            logits = hf_llama(torch.tensor([prompt + ids])).logits[0, -1:].float()
            m.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(logits, mask)
            t = int(logits.argmax())
            ids.append(t)
            assert m.accept_token(t)
            if m.is_terminated():
                break
        return ids

    return run


def _workload(seed: int = 0) -> tuple[list[list[int]], list[dict[str, Any]]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 390) for _ in range(12)]
    names = list(SCHEMAS)
    prompts, params = [], []
    for i in range(8):
        prompts.append((shared if i % 2 else []) + [rng.randrange(3, 390) for _ in range(rng.randrange(3, 30))])
        p: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": 120 if i % 2 == 0 else 12, "ignore_eos": i % 2 == 1}
        if i % 4 == 0:
            p["json_schema"] = json.dumps(SCHEMAS[names[i % len(names)]])
        elif i % 4 == 2:
            p["regex"] = REGEX
        params.append(p)
    return prompts, params


@pytest.mark.parametrize("kw, overlap", [
    ({}, False),
    ({}, True),
    ({"chunked_prefill_size": 8, "enable_mixed_chunk": True}, False),
    ({"max_total_tokens": 100}, True),  # retraction: a retracted request keeps its matcher and tokens
])
def test_mixed_batch_matches_hf(make_engine, tiny_llama, hf_greedy, hf_constrained, kw, overlap):
    e = make_engine(tiny_llama, **kw)
    e.scheduler.overlap = overlap  # CPU launches synchronously, but the bookkeeping is the GPU's
    deferred = []  # overlap: the masks join each batch after its forward is queued
    sample_deferred = e.worker.sample_deferred
    e.worker.sample_deferred = lambda *a: deferred.append(1) or sample_deferred(*a)
    prompts, params = _workload()
    outs = e.generate(input_ids=prompts, sampling_params=params)
    assert bool(deferred) == overlap
    for prompt, p, o in zip(prompts, params, outs):
        grammar = SamplingParams.from_dict(p).grammar
        if grammar is None:
            assert o["output_ids"] == hf_greedy(prompt, p["max_new_tokens"])
            continue
        assert o["output_ids"] == hf_constrained(prompt, *grammar, p["max_new_tokens"])
        assert o["finish_reason"] == "stop"
        text = e.tokenizer.decode(o["output_ids"])
        if grammar[0] == "regex":
            assert re.fullmatch(REGEX, text)
        else:
            jsonschema.validate(json.loads(text), json.loads(grammar[1]))
    if "max_total_tokens" in kw:
        assert e.get_stats().retractions > 0


def test_complete_grammar_ends_request_even_with_ignore_eos(engine):
    out = engine.generate("hi", {"regex": "[a-z]{2,4}", "ignore_eos": True, "max_new_tokens": 30, "temperature": 1.0})
    assert out["finish_reason"] == "stop" and re.fullmatch("[a-z]{2,4}", out["text"])


@pytest.mark.parametrize("field, value", [
    ("json_schema", '{"type": "objec"}'),
    ("json_schema", '{"type": "object", '),
    ("regex", "a(b"),
    ("ebnf", 'root ::= undefined_rule'),
])
def test_invalid_grammar_names_its_field(engine, field, value):
    with pytest.raises(InvalidRequestError) as e:
        engine.generate("hi", {field: value})
    assert e.value.param == field and e.value.code == "invalid_grammar"


def test_two_grammars_are_refused(engine):
    with pytest.raises(InvalidRequestError, match="at most one") as e:
        engine.generate("hi", {"regex": "a", "ebnf": 'root ::= "a"'})
    assert e.value.param == "ebnf"


def test_scheduler_fails_an_unchecked_bad_grammar_alone(engine):
    """A caller that skips the compile check (raw GenerateRequest): the request ends with an error naming
    the field; a request running beside it is untouched."""
    import asyncio

    bad = GenerateRequest(rid="bad-grammar", input_ids=[5, 6, 7],
                          sampling_params=SamplingParams(json_schema='{"type": "objec"}'))
    good = engine.make_request(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 6, "ignore_eos": True})

    async def run(req):
        return [o async for o in engine.stream(req)]

    async def both():
        return await asyncio.gather(run(bad), run(good))

    bad_outs, good_outs = asyncio.run(both())
    fr = bad_outs[-1].finish_reason
    assert fr.kind == "error" and "json_schema" in fr.message
    assert sum(len(o.new_token_ids) for o in good_outs) == 6


def test_compile_timeout_in_process(make_engine, tiny_llama):
    e = make_engine(tiny_llama, grammar_compile_timeout_s=1e-4)
    schema = json.dumps({**SCHEMAS["nested"], "title": f"never-seen-{time.time_ns()}"})
    with pytest.raises(InvalidRequestError, match="did not compile within") as err:
        e.generate("hi", {"json_schema": schema})
    assert err.value.param == "json_schema" and err.value.code == "grammar_timeout"


def test_abort_while_compiling_and_running(engine, pool_full):
    import asyncio

    schema = json.dumps({**SCHEMAS["matrix"], "title": f"abort-{time.time_ns()}"})
    reqs = [GenerateRequest(rid=f"ab-{i}", input_ids=[9, 10, 11 + i],
                            sampling_params=SamplingParams(json_schema=schema, max_new_tokens=50, ignore_eos=True))
            for i in range(4)]

    async def go():
        streams = [engine.stream(r) for r in reqs]
        first = await streams[0].__anext__()  # one runs; the others may still be compiling or queued
        await engine.abort(reqs[1].rid)
        for s in streams:
            await s.aclose()
        return first

    assert asyncio.run(go()).rid == "ab-0"
    pool_full(engine)


def test_64_concurrent_constrained_and_free(engine, pool_full):
    names = list(SCHEMAS)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 390) for _ in range(rng.randrange(2, 20))] for _ in range(64)]
    params = [{"temperature": 1.0, "seed": i, "max_new_tokens": 150,
               **({"json_schema": json.dumps(SCHEMAS[names[i % len(names)]])} if i % 2 == 0 else {})}
              for i in range(64)]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    for p, o in zip(params, outs):
        if "json_schema" in p:
            assert o["finish_reason"] == "stop"
            jsonschema.validate(json.loads(o["text"]), json.loads(p["json_schema"]))
        else:
            assert o["finish_reason"] in ("stop", "length")
    pool_full(engine)
