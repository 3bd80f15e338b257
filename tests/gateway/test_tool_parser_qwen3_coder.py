"""--tool-call-parser qwen3_coder: Qwen3-Coder's XML-style calls on fixed text — content before, between and
after, parameter text typed by the request's tool schemas (as vLLM converts it), values holding literal
tags, a missing </parameter>, malformed or unfinished calls as content — each parsed whole and streamed
char by char and in random pieces alike (check_stream, stream_check; the other formats' tests share them,
random_fragments and streamed_chat); and one request through the gateway, where the tools reach the parser."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

import openai
import pytest

from runtime import ServerArgs
from runtime.gateway.chat_output import ChatOutput
from runtime.gateway.server import serve_in_thread
from runtime.gateway.tool_parsers import create_tool_parser, tool_parser_names
from runtime.gateway.tool_parsers.param_text import convert

PROPS = {"city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
         "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
         "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"type": "string"}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": PROPS}}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}}}}}]


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def stream_check(factory: Callable[[], ChatOutput], text: str, raw_args: bool = False
                 ) -> tuple[ChatOutput, list[tuple[str, str]]]:
    """Parses text whole, then feeds it char by char and in random pieces: at every step what went out as
    content is a prefix of the whole answer's content (no partial tag leaks), and the deltas add up to the
    same reasoning and content; each call's id, type and name come first, once, its arguments after. The
    streamed calls whose id the finished message keeps are its calls, in order, arguments exact. One that
    went out but never settled (cut off, malformed) is content in the whole answer: its name is in that
    content, and so are its streamed arguments where they are the model's own text (raw_args: the JSON
    formats). Returns the whole parse and the char-by-char stream's unsettled calls (name, arguments)."""
    whole = factory()
    whole.update(text, final=True)
    want = [(c.function.name, c.function.arguments) for c in whole.tool_calls()]
    rng = random.Random(len(text))
    splits = [list(range(1, len(text) + 1))]
    for _ in range(3):
        cuts, cut = [], 0
        while cut < len(text):
            cut = min(len(text), cut + rng.randint(1, 6))
            cuts.append(cut)
        splits.append(cuts)
    unsettled: list[list[tuple[str, str]]] = []
    for cuts in splits:
        out, content, reasoning, calls = factory(), "", "", {}
        for cut, final in [(c, False) for c in cuts] + [(len(text), True)]:
            d = out.update(text[:cut], final=final)
            content, reasoning = content + d.content, reasoning + d.reasoning
            assert whole.content.startswith(content) and whole.reasoning.startswith(reasoning), text[:cut]
            assert len({tc.index for tc in d.tool_calls}) == len(d.tool_calls), "an index once a chunk"
            for tc in d.tool_calls:
                if tc.index not in calls:  # its name once, first, with its arguments so far
                    assert tc.index == len(calls) and tc.id and tc.type == "function" and tc.function.name
                    calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments]
                else:
                    assert not tc.id and not tc.function.name and tc.function.arguments
                    calls[tc.index][2] += tc.function.arguments
        assert (content, reasoning) == (whole.content, whole.reasoning)
        ids = [c.id for c in out.tool_calls()]
        assert [(n, a) for i, n, a in calls.values() if i in ids] == want
        unsettled.append([(n, a) for i, n, a in calls.values() if i not in ids])
        for name, args in unsettled[-1]:
            assert name in whole.content and (not raw_args or args in whole.content), (name, args)
    return whole, unsettled[0]


def check_stream(factory: Callable[[], ChatOutput], text: str, raw_args: bool = False) -> ChatOutput:
    """stream_check's whole parse."""
    return stream_check(factory, text, raw_args)[0]


def random_fragments(fmt: str, pieces: list[str], tools=TOOLS, n: int = 400) -> None:
    """Texts strung at random from the format's pieces (markers, names, brackets): parse never raises on
    any prefix, and every text streams alike (check_stream; the JSON formats' arguments are the model's
    text, qwen3_coder's and pythonic's are built)."""
    rng = random.Random(fmt)
    for _ in range(n):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 16)))
        parser = create_tool_parser(fmt, tools)
        for k in range(len(text)):
            parser.parse(text[:k], False)
        parser.parse(text, True)
        check_stream(lambda: ChatOutput(None, create_tool_parser(fmt, tools)), text,
                     raw_args=fmt in ("hermes", "llama3_json", "mistral"))


def streamed_chat(client: openai.OpenAI, **kw: Any) -> tuple[str, str, dict[int, list[str]]]:
    """(content, reasoning, {index: [name, arguments]}) of a streamed chat completion, each put together
    from its deltas."""
    content, reasoning, calls = "", "", {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            for d in ch.delta.tool_calls or []:
                calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
    return content, reasoning, calls


def parsed(text: str, tools=TOOLS) -> tuple[str, list[tuple[str, dict]]]:
    out = check_stream(lambda: ChatOutput(None, create_tool_parser("qwen3_coder", tools)), text)
    return out.content, [(c.function.name, json.loads(c.function.arguments)) for c in out.tool_calls()]


def test_typed_parameters_and_content_around_calls():
    assert "qwen3_coder" in tool_parser_names()
    text = ("Let me check.\n" + call("get_weather", city="Paris", days="3", temp="2.5", metric="True",
                                      opts="{'unit': 'C', 'n': [1, 2]}", tags='["a", 2]', note="None")
            + "\n" + call("search", query="42", top_k="five") + "\nDone!")
    content, calls = parsed(text)
    assert content == "Let me check.\n\n\nDone!"
    assert calls == [("get_weather", {"city": "Paris", "days": 3, "temp": 2.5, "metric": True,
                                      "opts": {"unit": "C", "n": [1, 2]}, "tags": ["a", 2], "note": None}),
                     ("search", {"query": "42", "top_k": "five"})]  # "five" is no integer: the text stays


def test_values_hold_code_and_literal_tags():
    code = 'if a < b:\n    s = "</parameter> and <tool_call> and </function>"\n\n'
    content, calls = parsed(call("get_weather", code=code, city="Oslo"))
    assert content == "" and calls == [("get_weather", {"code": code, "city": "Oslo"})]


def test_missing_closing_tags_and_bare_function():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</function>\n"
            "</tool_call>")  # no </parameter> at all: the next schema parameter and </function> end the values
    assert parsed(text) == ("", [("get_weather", {"city": "Paris", "days": 2})])
    text = "Sure.\n<function=search>\n<parameter=query>\ncats\n</parameter>\n</function>\nok"  # no <tool_call>
    assert parsed(text) == ("Sure.\nok", [("search", {"query": "cats"})])


def test_without_schemas_values_are_strings():
    text = call("get_weather", days="3") + call("other", x="1")
    assert parsed(text, tools=None) == ("", [("get_weather", {"days": "3"}), ("other", {"x": "1"})])
    assert parsed(text)[1] == [("get_weather", {"days": 3}), ("other", {"x": "1"})]  # an unknown function's too


@pytest.mark.parametrize("value, schema, want", [
    ("3", {"type": "integer"}, 3), ("3.0", {"type": "number"}, 3), ("-1e3", {"type": "number"}, -1000),
    ("1e999", {"type": "number"}, "1e999"), ("nan", {"type": "number"}, "nan"), ("x", {"type": "integer"}, "x"),
    ("FALSE", {"type": "boolean"}, False), ("maybe", {"type": "boolean"}, "maybe"),
    ("null", {"type": "string"}, "null"), ("null", {"type": ["string", "null"]}, None),
    ("None", {"type": "integer"}, None), ("{1, 2}", {"type": "array"}, "{1, 2}"),
    ('"{\'a\': 1}"', {"type": "object"}, {"a": 1}), ("(1, 2)", {"type": "array"}, [1, 2]),
    ("[1, 2", {"type": "array"}, "[1, 2"), ("3", {}, "3"), ("3", None, "3"), ("7", {"type": "weird"}, 7),
])
def test_param_text_conversion(value, schema, want):
    assert json.loads(json.dumps(convert(value, schema))) == want


@pytest.mark.parametrize("text, streamed", [
    ("Plain text, a < b and <tool", []), ("<tool_call>\nnot a call\n</tool_call> ok", []),
    ("<tool_call>\n<function=get weather>\n</function>\n</tool_call>", []), ("Use <function={{ tc.name }}> here", []),
    ("<tool_call>\n<function=search>\ngarbage\n</function>\n</tool_call>", []),
    ("Sure.\n<tool_call>\n<function=search>\n<parameter=query>\ncut off", [("search", '{"query": "cut off')]),
    ("<tool_call>\n<function=sea", []),
    (call("search", query="x")[:-len("</function>\n</tool_call>")], [("search", '{"query": "x')]),  # after </parameter>
])
def test_malformed_or_unfinished_is_content(text, streamed):
    """The finished message has the text as content and no call; the stream sent a call only once a
    parameter began (a body that is not parameters is content), and only its value as far as it is sure."""
    out, unsettled = stream_check(lambda: ChatOutput(None, create_tool_parser("qwen3_coder", TOOLS)), text)
    assert (out.content, out.tool_calls()) == (text, [])
    assert unsettled == streamed


def test_random_fragments():
    random_fragments("qwen3_coder", ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
                                     "</parameter>", "search", "query", "top_k", ">", "\n", " ", "3", "x", "<"])


def test_call_then_unfinished_call():
    first = call("search", query="a")
    assert parsed(first + "\n<tool_call>\n<function=search>\n") == (
        "\n<tool_call>\n<function=search>\n", [("search", {"query": "a"})])


@pytest.fixture(scope="module")
def client(gw_engine):
    with serve_in_thread(gw_engine, ServerArgs(tool_call_parser="qwen3_coder"), port=0) as h:
        yield openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_through_the_gateway(client):
    """A regex makes the tiny model write the format; the request's schema types top_k as an integer."""
    regex = (r"[A-Z][a-z]{1,6}\.\n<tool_call>\n<function=search>\n<parameter=query>\n[a-z]{1,6}\n</parameter>\n"
             r"<parameter=top_k>\n[1-5]\n</parameter>\n</function>\n</tool_call>")
    kw = dict(model="llama", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS, max_tokens=300,
              temperature=0, extra_body={"regex": regex})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and re.fullmatch(r"[A-Z][a-z]{1,6}\.\n", c.message.content)
    (tc,) = c.message.tool_calls
    args = json.loads(tc.function.arguments)
    assert tc.function.name == "search" and set(args) == {"query", "top_k"} and isinstance(args["top_k"], int)
    content, _, calls = streamed_chat(client, **kw)
    assert content == c.message.content and calls == {0: ["search", tc.function.arguments]}
