"""--tool-call-parser pythonic: Llama 3.2 / Llama 4 Python-list calls on fixed text — keyword literals to JSON,
Llama 4's <|python_start|>...<|python_end|> with content around it, text after the list; prose, non-literal
arguments (nothing is evaluated) and unfinished lists as content — each parsed whole and streamed alike
(check_stream); and one request through the gateway."""

from __future__ import annotations

import json
import re

import openai
import pytest
from test_tool_parser_qwen3_coder import check_stream, random_fragments, streamed_chat

from runtime import ServerArgs
from runtime.gateway.chat_output import ChatOutput
from runtime.gateway.server import serve_in_thread
from runtime.gateway.tool_parsers import create_tool_parser, tool_parser_names


def parsed(text: str) -> tuple[str, list[tuple[str, dict]]]:
    out = check_stream(lambda: ChatOutput(None, create_tool_parser("pythonic")), text)
    return out.content, [(c.function.name, json.loads(c.function.arguments)) for c in out.tool_calls()]


@pytest.mark.parametrize("text, content, calls", [
    ('[get_weather(city="Paris"), add(a=1, b=2.5)]', "", [("get_weather", {"city": "Paris"}),
                                                          ("add", {"a": 1, "b": 2.5})]),
    ("[f(s='it\\'s ]) \"x\"', n=-3, t=(1, 2), d={'k': [None, True, false]}, e=[], u='\u00e9')]", "",
     [("f", {"s": "it's ]) \"x\"", "n": -3, "t": [1, 2], "d": {"k": [None, True, False]}, "e": [], "u": "\u00e9"})]),
    ('[f(doc="""a\n]b""")]', "", [("f", {"doc": "a\n]b"})]),
    ("  [ping()]", "", [("ping", {})]),
    ('<|python_start|>[get_weather(city="Oslo")]<|python_end|>', "", [("get_weather", {"city": "Oslo"})]),
    ('Checking. <|python_start|>[a(x=1), b(y="z")]<|python_end|> Back soon.', "Checking.  Back soon.",
     [("a", {"x": 1}), ("b", {"y": "z"})]),
    ('[f(x=1)]\n\nThat was the call.', "\n\nThat was the call.", [("f", {"x": 1})]),
])
def test_calls(text, content, calls):
    assert "pythonic" in tool_parser_names()
    assert parsed(text) == (content, calls)


@pytest.mark.parametrize("text", [
    "Plain answer.", "[1, 2] is a list", "[Note](link)", "See [f(x=1)] for details",  # the list must open
    "[f(1)]", "[f(x=g())]", "[f(x={1, 2})]", "[f(**kw)]", "[os.system(cmd='ls')]", "[f(x=1e999)]",
    "[f(x={1: 2})]", "[f(x=b'raw')]", "[f(x=1), 3]", "[f(x=1) g(y=2)]",
    '[f(x=__import__("os").system("echo pwned"))]',  # read, never run
    "[f(x=1", '[f(x="]', "<|python_start|>[f(x=1)", "<|python_start|>not a list",
])
def test_not_calls_are_content(text):
    assert parsed(text) == (text, [])


def test_random_fragments():
    random_fragments("pythonic", ["[", "]", "(", ")", "f", "=", "x", "1", "'", '"', "\\", ",", " ", "{", "}", ":",
                                  "None", "-", '"""', "\n", "<|python_start|>", "<|python_end|>"])


@pytest.fixture(scope="module")
def client(gw_engine):
    with serve_in_thread(gw_engine, ServerArgs(tool_call_parser="pythonic"), port=0) as h:
        yield openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_through_the_gateway(client):
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}}}}}]
    kw = dict(model="llama", messages=[{"role": "user", "content": "Hi"}], tools=tools, max_tokens=200,
              temperature=0, extra_body={"regex": r'\[search\(query="[a-z]{1,6}", top_k=[1-5]\)\]'})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    (tc,) = c.message.tool_calls
    args = json.loads(tc.function.arguments)
    assert tc.function.name == "search" and re.fullmatch("[a-z]{1,6}", args["query"]) and args["top_k"] in range(1, 6)
    content, _, calls = streamed_chat(client, **kw)
    assert content == "" and calls == {0: ["search", tc.function.arguments]}
