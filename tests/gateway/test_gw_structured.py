"""Structured output and tool calling over HTTP with the official openai client, on the tiny random-weight
Llama: chat.completions.parse with a Pydantic model; 100% of outputs under every schema of
structured_schemas validate; json_object output that ends parses; regex / ebnf outputs match on chat,
completions and /generate; tool_choice required and named give arguments that validate, as
tool_calls deltas that concatenate to the non-streamed call; auto tool calls and reasoning go through
--tool-call-parser / --reasoning-parser; the three 400s; 64 concurrent mixed requests leave the KV
pool full."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from gw_helpers import http, wait_kv_full
from pydantic import BaseModel, Field
from structured_schemas import SCHEMAS

from runtime import Engine, ServerArgs
from runtime.gateway.server import serve_in_thread

pytest.importorskip("xgrammar")

MODEL = "llama"
MSG = [{"role": "user", "content": "Hello"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                     "top_k": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Address(BaseModel):
    street: str = Field(max_length=10)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    address: Address
    nickname: str | None = Field(default=None, max_length=6)


def test_parse_pydantic_model(oai):
    for seed in range(3):
        r = oai.chat.completions.parse(model=MODEL, messages=MSG, response_format=Person, max_tokens=200,
                                       temperature=1.0, seed=seed)
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
        assert Person.model_validate_json(r.choices[0].message.content) == person


def test_every_schema_validates(oai):
    """12 schemas x 4 choices, sampled at temperature 1, all in flight together: every output validates."""
    def ask(name: str) -> list[Any]:
        r = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Give me {name}"}], n=4, temperature=1.0,
            seed=len(name), max_tokens=250,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}})
        return r.choices

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = dict(zip(SCHEMAS, pool.map(ask, SCHEMAS)))
    for name, choices in results.items():
        assert len(choices) == 4
        for c in choices:
            assert c.finish_reason == "stop", (name, c.message.content)
            jsonschema.validate(json.loads(c.message.content), SCHEMAS[name])


def test_json_object(oai):
    """Any object: with random weights a string may run to max_tokens ("length", cut mid-object); every
    output that ends is one JSON object."""
    r = oai.chat.completions.create(model=MODEL, messages=MSG, n=4, temperature=1.0, seed=3, max_tokens=300,
                                    response_format={"type": "json_object"})
    ended = [c for c in r.choices if c.finish_reason == "stop"]
    assert ended and all(c.finish_reason == "length" for c in r.choices if c not in ended)
    for c in ended:
        assert isinstance(json.loads(c.message.content), dict)


def test_max_tokens_mid_object_is_length(oai):
    r = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, response_format={
        "type": "json_schema", "json_schema": {"name": "nested", "schema": SCHEMAS["nested"]}})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


REGEX = r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}"
EBNF = 'root ::= ("yes" | "no" | "maybe") " because " [a-z]{1,8}'


def test_regex_and_ebnf_everywhere(oai, gw_url):
    r = oai.chat.completions.create(model=MODEL, messages=MSG, n=4, temperature=1.0, max_tokens=40,
                                    extra_body={"regex": REGEX})
    assert all(re.fullmatch(REGEX, c.message.content) for c in r.choices)
    r = oai.completions.create(model=MODEL, prompt="Say", n=4, temperature=1.0, max_tokens=40, extra_body={"ebnf": EBNF})
    assert all(re.fullmatch(r"(yes|no|maybe) because [a-z]{1,8}", c.text) for c in r.choices)
    r = oai.completions.create(model=MODEL, prompt="JSON:", max_tokens=200, temperature=1.0, seed=4, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["patterns"]}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["patterns"])
    for sp, check in (({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
                      ({"json_schema": SCHEMAS["enums"]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS["enums"]) or True)):
        status, body = http(gw_url + "/generate", "POST", {"text": "Hi", "sampling_params": {
            "max_new_tokens": 100, "temperature": 1.0, **sp}})
        assert status == 200 and check(body["text"]), body


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def _streamed_calls(stream) -> tuple[dict[int, list[str]], str | None]:
    """{index: [id, name, arguments]} from tool_calls deltas (the name must come first), finish_reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    pieces = 0
    for chunk in stream:
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name, "a call's first delta carries its id and name"
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                else:
                    assert tc.function.name is None
                calls[tc.index][2] += tc.function.arguments or ""
                pieces += bool(tc.function.arguments)
    assert pieces > len(calls), "arguments come in pieces"
    return calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_tool_calls(oai, choice):
    """A call the model chose ("required") ends "tool_calls"; one the request named ends "stop", as OpenAI's
    and vLLM's do, streamed and not."""
    kw = dict(model=MODEL, messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=450)  # ~1 token a character
    finished = "tool_calls" if choice == "required" else "stop"
    for seed in range(4):
        r = oai.chat.completions.create(**kw, temperature=1.0, seed=seed, n=2)
        for c in r.choices:
            assert c.finish_reason == finished and c.message.tool_calls
            assert len({tc.id for tc in c.message.tool_calls}) == len(c.message.tool_calls)
            for name, args in _calls(c.message):
                assert choice == "required" or name == "get_weather"
                jsonschema.validate(args, SCHEMA_OF[name])
    full = oai.chat.completions.create(**kw, temperature=0)
    streamed, finish = _streamed_calls(oai.chat.completions.create(**kw, temperature=0, stream=True))
    assert finish == finished
    assert [(v[1], v[2]) for _, v in sorted(streamed.items())] == [
        (tc.function.name, tc.function.arguments) for tc in full.choices[0].message.tool_calls]


def test_parallel_tool_calls_false_gives_one_call(oai):
    for seed in range(4):
        r = oai.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=450)
        assert len(r.choices[0].message.tool_calls) == 1


def test_tool_history_messages(oai):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_tool_template_receives_tools(tiny_llama):
    from runtime.text.tokenizer import Tokenizer

    tmpl = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    tok = Tokenizer(tiny_llama, chat_template=tmpl)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS)
    assert tok.decode(ids) == "[get_weather][search]hi"


@pytest.fixture(scope="module")
def parser_server(gw_engine):
    """The same engine behind a gateway with the hermes tool-call parser and the qwen3 reasoning parser."""
    with serve_in_thread(gw_engine, ServerArgs(tool_call_parser="hermes", reasoning_parser="qwen3"), port=0) as h:
        yield openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_auto_tool_calls_and_reasoning_through_parsers(parser_server):
    """A regex makes the random model write Qwen's own format; the parsers turn it into reasoning_content,
    content and tool_calls, streamed and not, alike."""
    regex = (r'<think>[a-z ]{1,12}</think>\n[A-Z][a-z]{1,8}\.\n<tool_call>\n\{"name": "search", "arguments": '
             r'\{"query": "[a-z]{1,8}"\}\}\n</tool_call>')
    kw = dict(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=120, temperature=0, extra_body={"regex": regex})
    r = oai_msg = parser_server.chat.completions.create(**kw)
    msg = oai_msg.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert re.fullmatch(r"[a-z ]{1,12}", msg.model_extra["reasoning_content"])
    assert re.fullmatch(r"[A-Z][a-z]{1,8}\.\n", msg.content)
    (name, args), = _calls(msg)
    assert name == "search" and re.fullmatch(r"[a-z]{1,8}", args["query"])
    reasoning, content = "", ""
    calls: dict[int, list[str]] = {}
    for chunk in parser_server.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            d = ch.delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
    assert (reasoning, content) == (msg.model_extra["reasoning_content"], msg.content)
    assert calls == {0: ["search", msg.tool_calls[0].function.arguments]}


def test_json_output_is_content_under_a_reasoning_parser(gw_engine):
    """deepseek-r1 reads an output as reasoning until </think>; a JSON grammar's output has none: content."""
    with serve_in_thread(gw_engine, ServerArgs(reasoning_parser="deepseek-r1"), port=0) as h:
        client = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=200, response_format={
            "type": "json_schema", "json_schema": {"name": "enums", "schema": SCHEMAS["enums"]}})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["enums"])
        r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=40,
                                           extra_body={"regex": "[a-z]{1,8}</think>[A-Z][a-z]{1,8}"})
        msg = r.choices[0].message
        assert re.fullmatch("[a-z]{1,8}", msg.model_extra["reasoning_content"])
        assert re.fullmatch("[A-Z][a-z]{1,8}", msg.content)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}}},
     "response_format.json_schema.schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"regex": "a(b"}, "regex"),
    ({"ebnf": "root ::= missing"}, "ebnf"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integr"}}}],
      "tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
])
def test_bad_grammars_are_400_naming_the_field(gw_url, gw_engine, body, param):
    status, err = http(gw_url + "/v1/chat/completions", "POST", {"model": MODEL, "messages": MSG, **body})
    assert status == 400 and err["error"]["param"] == param, err
    status, err = http(gw_url + "/generate", "POST", {"text": "hi", "sampling_params": {"json_schema": "{"}})
    assert status == 400 and err["error"]["param"] == "sampling_params.json_schema", err
    wait_kv_full(gw_engine)


def test_compile_timeout_is_400(tiny_llama):
    engine = Engine(str(tiny_llama), device="cpu", max_total_tokens=1024, grammar_compile_timeout_s=1e-4,
                    log_level="warning")
    try:
        with serve_in_thread(engine, ServerArgs(), port=0) as h:
            schema = {**SCHEMAS["nested"], "title": f"unseen-{time.time_ns()}"}
            status, err = http(h.url + "/v1/chat/completions", "POST", {"messages": MSG, "response_format": {
                "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
            assert status == 400 and err["error"]["param"] == "response_format.json_schema.schema", err
            assert err["error"]["code"] == "grammar_timeout" and "did not compile within" in err["error"]["message"]
            status, body = http(h.url + "/v1/chat/completions", "POST", {"messages": MSG, "max_tokens": 3})
            assert status == 200  # nothing else stalls
            wait_kv_full(engine)
    finally:
        engine.shutdown()


def test_64_concurrent_mixed_requests_leave_pool_full(oai, gw_engine):
    names = list(SCHEMAS)

    def one(i: int) -> None:
        kw: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": f"req {i}"}], temperature=1.0,
                                  seed=i, max_tokens=120)
        if i % 4 == 0:
            name = names[i % len(names)]
            r = oai.chat.completions.create(**kw, response_format={
                "type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}})
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])
        elif i % 4 == 1:
            r = oai.chat.completions.create(**{**kw, "max_tokens": 450}, tools=TOOLS, tool_choice="required")
            for name, args in _calls(r.choices[0].message):
                jsonschema.validate(args, SCHEMA_OF[name])
        elif i % 4 == 2:
            r = oai.chat.completions.create(**kw, extra_body={"regex": REGEX})
            assert re.fullmatch(REGEX, r.choices[0].message.content)
        else:
            r = oai.chat.completions.create(**kw)
            assert r.choices[0].finish_reason in ("stop", "length")

    with ThreadPoolExecutor(64) as pool:
        list(pool.map(one, range(64)))
    wait_kv_full(gw_engine)
