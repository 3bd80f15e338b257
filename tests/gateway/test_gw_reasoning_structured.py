"""Reasoning-aware structured output over HTTP (vLLM's and SGLang's behaviour), on a tiny random reasoning
model whose tokenizer spells <think> and </think> as one token each: under --reasoning-parser a
response_format / tool_choice grammar waits for </think>, so the reply has the free reasoning in
reasoning_content and the grammar's JSON in content (streamed alike); a prompt that already closed the
reasoning (enable_thinking false) gets the grammar from the first token; reasoning that never ends
finishes with "length"; a tokenizer without a one-token </think> keeps the grammar from the first token.
The random model closes its reasoning through a logit_bias on </think> and a seed found by the engine
(seeded sampling is a pure function of seed, position and token, so HTTP samples the same tokens)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from gw_helpers import GATEWAY_ARGS, http, sse_events, wait_kv_full
from tiny_think_model import make_think_model

from runtime import Engine
from runtime.gateway.reasoning_parsers.grammar_gate import GrammarGate, grammar_gate, turn_opening
from runtime.gateway.server import serve_in_thread

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
          "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "color", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "hi"}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": CITY}}]
BIAS = 4.0


@pytest.fixture(scope="module")
def think(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, dict[str, str]]]:
    """The engine and a gateway per reasoning parser in front of it."""
    engine = Engine(str(make_think_model(tmp_path_factory.mktemp("think") / "model")), device="cpu",
                    max_total_tokens=4096)
    try:
        with serve_in_thread(engine, GATEWAY_ARGS.replace(reasoning_parser="deepseek-r1"), port=0) as r1, \
                serve_in_thread(engine, GATEWAY_ARGS.replace(reasoning_parser="qwen3"), port=0) as qwen3:
            yield engine, {"deepseek-r1": r1.url, "qwen3": qwen3.url}
    finally:
        engine.shutdown()


def _end(engine: Engine) -> int:
    (end,) = engine.tokenizer.encode("</think>", add_special_tokens=False)
    return end


def _closing_seed(engine: Engine) -> tuple[int, str]:
    """A seed whose free run writes a few ASCII tokens of reasoning, then </think>; and that reasoning."""
    ids, end = engine.tokenizer.apply_chat_template(MESSAGES), _end(engine)
    for seed in range(300):
        out = engine.generate(input_ids=ids, sampling_params={
            "temperature": 1.0, "seed": seed, "logit_bias": {end: BIAS}, "max_new_tokens": 30})["output_ids"]
        if end not in out or out.index(end) < 3:
            continue
        text = engine.tokenizer.decode(out[:out.index(end)])
        if text.isascii() and text.isprintable() and text == text.lstrip() and "<think>" not in text:
            return seed, text
    raise AssertionError("no seed closes the reasoning after a few printable tokens")


def _chat(url: str, **body: Any) -> dict[str, Any]:
    status, r = http(url + "/v1/chat/completions", "POST", {"messages": MESSAGES, "max_tokens": 80, **body})
    assert status == 200, r
    return r


def _stream(url: str, **body: Any) -> tuple[str, str, dict[int, list[str]], str | None]:
    """(reasoning, content, tool calls by index as [name, arguments], finish_reason) of a streamed reply."""
    status, raw = http(url + "/v1/chat/completions", "POST",
                       {"messages": MESSAGES, "max_tokens": 80, "stream": True, **body})
    assert status == 200, raw
    reasoning, content, calls, finish = "", "", {}, None
    for ev in sse_events(raw):
        if ev == "[DONE]":
            continue
        for ch in ev["choices"]:
            d = ch["delta"]
            reasoning += d.get("reasoning_content") or ""
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                calls.setdefault(tc["index"], [tc["function"].get("name"), ""])[1] += tc["function"].get("arguments") or ""
            finish = ch.get("finish_reason") or finish
    return reasoning, content, calls, finish


def test_json_after_reasoning(think):
    engine, urls = think
    seed, reasoning = _closing_seed(engine)
    body = {"response_format": FORMAT, "seed": seed, "logit_bias": {str(_end(engine)): BIAS}}
    r = _chat(urls["deepseek-r1"], **body)
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == reasoning
    jsonschema.validate(json.loads(msg["content"]), SCHEMA)
    assert r["choices"][0]["finish_reason"] == "stop"
    assert _stream(urls["deepseek-r1"], **body) == (reasoning, msg["content"], {}, "stop")
    wait_kv_full(engine)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls_after_reasoning(think, choice):
    """tool_choice "required" and a named function wait for </think> too (as in vLLM)."""
    engine, urls = think
    seed, reasoning = _closing_seed(engine)
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "weather"}}
    # one call (the random model may write several where parallel calls are allowed)
    body = {"tools": TOOLS, "tool_choice": tool_choice, "seed": seed, "logit_bias": {str(_end(engine)): BIAS},
            "parallel_tool_calls": False}
    r = _chat(urls["deepseek-r1"], **body)
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == reasoning and not msg["content"]
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)
    finished = "tool_calls" if choice == "required" else "stop"  # a named call ends "stop", as in vLLM
    assert r["choices"][0]["finish_reason"] == finished
    s_reasoning, s_content, calls, finish = _stream(urls["deepseek-r1"], **body)
    assert (s_reasoning, s_content, finish) == (reasoning, "", finished)
    assert calls == {0: ["weather", call["function"]["arguments"]]}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek-r1"])
def test_prompt_that_closed_reasoning_gets_the_grammar_from_the_first_token(think, parser):
    """enable_thinking false renders <think></think> in the prompt: a bias that would make </think> the
    first free token is overruled by the grammar, and the whole output is the answer."""
    engine, urls = think
    body = {"response_format": FORMAT, "seed": 0, "logit_bias": {str(_end(engine)): 100},
            "chat_template_kwargs": {"enable_thinking": False}}
    r = _chat(urls[parser], **body)
    msg = r["choices"][0]["message"]
    jsonschema.validate(json.loads(msg["content"]), SCHEMA)
    assert msg["reasoning_content"] == "" and r["choices"][0]["finish_reason"] == "stop"
    assert _stream(urls[parser], **body)[:2] == ("", msg["content"])
    # With the reasoning open the same bias closes it at once: the grammar waited for </think>.
    r = _chat(urls["deepseek-r1"], **{**body, "chat_template_kwargs": {}})
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == "" and r["usage"]["completion_tokens"] > 1
    jsonschema.validate(json.loads(msg["content"]), SCHEMA)


def test_reasoning_that_never_ends_finishes_with_length(think):
    engine, urls = think
    body = {"response_format": FORMAT, "seed": 1, "logit_bias": {str(_end(engine)): -100}, "max_tokens": 10,
            "ignore_eos": True}
    r = _chat(urls["deepseek-r1"], **body)
    msg = r["choices"][0]["message"]
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 10
    assert msg["reasoning_content"] and msg["content"] == ""
    reasoning, content, _, finish = _stream(urls["deepseek-r1"], **body)
    assert (reasoning, content, finish) == (msg["reasoning_content"], "", "length")
    wait_kv_full(engine)


class _Tok:
    """A tokenizer stand-in: <think> is 7; </think> is 8, or two pieces when split."""

    def __init__(self, split: bool = False) -> None:
        self.split = split

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return {"<think>": [7], "</think>": [5, 6] if self.split else [8]}[text]


@pytest.mark.parametrize("opening, gate", [
    ("<|im_start|>assistant\n<think>\n", GrammarGate(8, False)),  # DeepSeek-R1: the prompt opens the reasoning
    ("<|im_start|>assistant\n", GrammarGate(8, False)),  # Qwen3 thinking: the model opens it
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", GrammarGate(None, True)),  # enable_thinking false
    ("<think>a</think> then <think>b", GrammarGate(8, False)),  # a continued message: a new one open
    ("</think>", GrammarGate(None, True)),
])
def test_grammar_gate(opening, gate):
    assert grammar_gate(_Tok(), opening) == gate
    assert grammar_gate(_Tok(split=True), opening) is None  # the grammar cannot wait for two tokens


def test_tokenizer_without_one_token_think_end(gw_engine):
    """The tiny Llama's tokenizer splits </think>: no gate, the grammar keeps constraining from the first
    token (test_gw_structured's test_json_output_is_content_under_a_reasoning_parser checks the replies)."""
    assert len(gw_engine.tokenizer.encode("</think>", add_special_tokens=False)) > 1
    assert grammar_gate(gw_engine.tokenizer, "hi <think>") is None


def test_a_user_writing_think_end_has_not_closed_the_reasoning(think):
    """Only the turn's opening counts: a question that quotes "</think>" leaves the model to reason first,
    and a prefilled assistant message that closed its reasoning is continued as the answer."""
    engine, _ = think
    tok = engine.tokenizer
    asked = [{"role": "user", "content": "What does the </think> tag mean?"}]
    assert grammar_gate(tok, turn_opening(tok, asked, None, True, False, None)).reasoning_done is False
    closed = turn_opening(tok, asked, None, True, False, {"enable_thinking": False})
    assert grammar_gate(tok, closed).reasoning_done is True
    prefill = asked + [{"role": "assistant", "content": "<think>short</think>It"}]
    assert grammar_gate(tok, turn_opening(tok, prefill, None, False, True, None)).reasoning_done is True


def test_generate_route_takes_grammar_after_token(think):
    """/generate's sampling_params carry the field as it is: the same reply as the chat route's engine run."""
    engine, urls = think
    seed, reasoning = _closing_seed(engine)
    end = _end(engine)
    sp = {"temperature": 1.0, "seed": seed, "logit_bias": {str(end): BIAS}, "max_new_tokens": 60,
          "json_schema": json.dumps(SCHEMA), "grammar_after_token": end}
    ids = engine.tokenizer.apply_chat_template(MESSAGES)
    status, r = http(urls["qwen3"] + "/generate", "POST", {"input_ids": ids, "sampling_params": sp})
    assert status == 200, r
    head, answer = r["text"].split("</think>")
    assert head == reasoning
    jsonschema.validate(json.loads(answer), SCHEMA)
    status, err = http(urls["qwen3"] + "/generate", "POST", {"input_ids": ids, "sampling_params": {
        **sp, "grammar_after_token": 10**6}})
    assert status == 400 and "grammar_after_token" in err["error"]["param"], err


@pytest.mark.parametrize("parser", ["qwen3", "deepseek-r1"])
def test_prompt_that_closed_reasoning_without_a_grammar_is_all_answer(think, parser):
    """No grammar, enable_thinking false: the output is the answer, for DeepSeek-R1's parser too (which reads
    an output without </think> as reasoning unless it knows the prompt closed it)."""
    engine, urls = think
    body = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
    ids = engine.tokenizer.apply_chat_template(MESSAGES, template_kwargs={"enable_thinking": False})
    direct = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 8,
                                                             "ignore_eos": True})
    assert _end(engine) not in direct["output_ids"]  # nothing in the output itself closes any reasoning
    msg = _chat(urls[parser], **body)["choices"][0]["message"]
    assert msg["content"] == direct["text"] and not msg.get("reasoning_content")
    assert _stream(urls[parser], **body)[1] == direct["text"]
