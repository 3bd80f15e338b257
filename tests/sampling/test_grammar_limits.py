"""A hostile grammar costs no compile thread and blames no bystander: grammars past GrammarLimits (a
100k-value enum, thousands of properties, deep nesting, huge regexes) are refused before they queue;
a non-local $ref is refused rather than dropped; a grammar matching no text is refused at compile, and
one that dead-ends mid-output ends its request naming the grammar; the time limit counts from a
compile's start, so a grammar queued behind slow compiles gets GrammarBusyError (retry), never
grammar_timeout, and a full queue refuses at once."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from runtime.errors import InvalidRequestError
from runtime.managers.grammar_manager import GRAMMAR_BUSY, GrammarManager
from runtime.managers.req import Req
from runtime.sampling.grammar_compiler import GrammarBusyError, GrammarCompiler
from runtime.sampling.grammar_limits import GrammarLimits
from runtime.sampling.params import SamplingParams

pytest.importorskip("xgrammar")

VOCAB = [bytes([i]) for i in range(256)] + [b"</s>"]


def compiler(**kw) -> GrammarCompiler:
    return GrammarCompiler(VOCAB, len(VOCAB), [256], **{"timeout_s": 30.0, "threads": 1, "fill_threads": 1, **kw})


@pytest.fixture(scope="module")
def gc() -> GrammarCompiler:
    return compiler()


def refused(gc: GrammarCompiler, kind: str, text: str) -> InvalidRequestError:
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError) as e:
        gc.check((kind, text))
    assert time.monotonic() - t0 < 1.0  # refused up front, not after a compile
    assert e.value.param == kind
    return e.value


def nested(depth: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "array", "items": s}
    return s


@pytest.mark.parametrize(("kind", "text", "says"), [
    ("json_schema", json.dumps({"enum": [f"v_{i}" for i in range(100_000)]}), "bytes, over the limit"),
    ("json_schema", json.dumps({"anyOf": [{"enum": [f"v{i}" for i in range(6000)]}] * 2}), "enum/const values"),
    ("json_schema", json.dumps({"type": "object", "properties": {f"p{i}": {} for i in range(5001)}}),
     "5,001 object properties"),
    ("json_schema", json.dumps(nested(70)), "nests deeper than 64"),
    ("regex", "(" + "|".join(f"w{i}" for i in range(20_000)) + ")", "bytes, over the limit of 65,536"),
    ("ebnf", 'root ::= "' + "a" * 70_000 + '"', "bytes, over the limit"),
])
def test_grammars_past_the_limits_are_refused_before_compiling(gc, kind, text, says):
    e = refused(gc, kind, text)
    assert e.code == "grammar_too_large" and says in e.message, e.message


@pytest.mark.parametrize("ref", ["http://169.254.169.254/x", "file:///etc/passwd", "other.json#/a"])
def test_a_non_local_ref_is_refused(gc, ref):
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}
    e = refused(gc, "json_schema", json.dumps(schema))
    assert e.code == "invalid_grammar" and "only local $ref (#/...)" in e.message and ref in e.message


def test_local_refs_and_keyword_like_names_compile(gc):
    schema = {"$defs": {"n": {"type": "integer"}}, "type": "object",
              "properties": {"$ref": {"$ref": "#/$defs/n"}, "enum": {"type": "string", "default": {"$ref": "x"}}},
              "required": ["$ref"]}
    assert gc.check(("json_schema", json.dumps(schema))) is not None
    assert gc.check(("json_schema", json.dumps({"enum": [f"v{i}" for i in range(2000)]}))) is not None
    GrammarLimits().check("json_schema", json.dumps(nested(60)))  # 61 levels: within the limit


def test_guided_choice_counts_its_choices():
    from runtime.gateway.errors import ApiError
    from runtime.gateway.output_constraint import OutputConstraint

    with pytest.raises(ApiError) as e:
        OutputConstraint._choice([str(i) for i in range(10_001)], "guided_choice")
    assert e.value.status == 400 and e.value.param == "guided_choice" and e.value.code == "grammar_too_large"
    assert OutputConstraint._choice([str(i) for i in range(10_000)], "guided_choice").kind == "regex"


def test_a_grammar_matching_no_text_is_refused_at_compile(gc):
    e = refused(gc, "ebnf", "root ::= root")
    assert e.code == "invalid_grammar" and "matches no text" in e.message


def test_a_dead_end_mid_output_names_the_grammar(gc):
    key = ("ebnf", 'root ::= "a" b\nb ::= b')
    req = Req("r", [1], SamplingParams.from_dict({"ebnf": key[1]}), 0, frozenset())
    req.grammar = gc.matcher(gc.check(key))
    req.output_ids.append(ord("a"))
    GrammarManager.accept(req, ord("a"))
    assert req.finish_reason is None
    req.output_ids.append(ord("z"))  # all -inf row: the argmax lands anywhere
    GrammarManager.accept(req, ord("z"))
    fr = req.finish_reason
    assert fr.kind == "error" and fr.param == "ebnf" and "cannot be completed" in fr.message, fr
    ok = Req("s", [1], SamplingParams.from_dict({"regex": "[0-9]"}), 0, frozenset())
    ok.grammar = gc.matcher(gc.check(("regex", "[0-9]")))
    ok.output_ids.append(ord("z"))  # the mask allowed digits: a token outside it is the engine's failure
    GrammarManager.accept(ok, ord("z"))
    assert ok.finish_reason.param is None and "rejected sampled token" in ok.finish_reason.message


def slow_compiler(release: threading.Event, **kw) -> GrammarCompiler:
    """A compiler whose "slow" regex holds its only thread until release is set."""
    c = compiler(**kw)
    real = c._compile

    def compile_(kind: str, text: str):
        if text == "slow":
            release.wait(10)
        return real(kind, text)

    c._compile = compile_
    return c


def test_a_grammar_queued_behind_slow_compiles_is_busy_not_blamed():
    release = threading.Event()
    c = slow_compiler(release, timeout_s=0.3)
    c.queue_wait_s = 0.3
    try:
        c.submit(("regex", "slow"))
        t0 = time.monotonic()
        with pytest.raises(GrammarBusyError) as e:
            asyncio.run(c.check_async(("regex", "[0-9]{3}")))
        assert 0.25 < time.monotonic() - t0 < 2 and "retry" in str(e.value) and e.value.retry_after_s > 0
        # the scheduler's view of a waiting request: busy (an engine code, a 503), not the request's fault
        mgr = GrammarManager(c, len(VOCAB))
        req = Req("q", [1], SamplingParams.from_dict({"regex": "[a-z]"}), 0, frozenset())
        assert not mgr.admit(req) and not req.finished
        time.sleep(0.35)
        assert mgr.poll() == ([], [req]) and req.finish_reason.code == GRAMMAR_BUSY and req.finish_reason.param is None
        assert c.queued == 0  # neither busy waiter left its job behind: both dropped, never run
    finally:
        release.set()
    # queued 0.3 s+ (longer than the time limit) yet compiled fast once started: not a timeout
    c2 = slow_compiler(release2 := threading.Event(), timeout_s=0.2)
    c2.submit(("regex", "slow"))
    threading.Timer(0.3, release2.set).start()
    assert c2.check(("regex", "[0-9]{2}")) is not None
    c.shutdown()
    c2.shutdown()


def test_a_full_queue_refuses_at_once_and_a_slow_compile_is_still_a_timeout():
    release = threading.Event()
    c = slow_compiler(release, max_queued=1, timeout_s=0.2)
    try:
        c.submit(("regex", "slow"))
        deadline = time.monotonic() + 5
        while c.queued and time.monotonic() < deadline:  # "slow" holds the thread
            time.sleep(0.01)
        c.submit(("regex", "a"))  # queued: the queue is full now
        with pytest.raises(GrammarBusyError):
            c.submit(("regex", "b"))
        assert c.submit(("regex", "a")) is not None  # a grammar already queued is not refused
    finally:
        threading.Timer(0.4, release.set).start()
    with pytest.raises(InvalidRequestError) as e:
        c.check(("regex", "slow"))  # ran 0.4 s from its start: past the 0.2 s limit
    assert e.value.code == "grammar_timeout" and e.value.param == "regex"
    c.shutdown()
