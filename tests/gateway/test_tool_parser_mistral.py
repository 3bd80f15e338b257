"""--tool-call-parser mistral on the v11+ format (Mistral Small 3.2, Magistral, Devstral):
[TOOL_CALLS]NAME[ARGS]{...} per call, with [CALL_ID] (v13) or without [ARGS], content around the calls, and
the same calls with their control tokens removed (skip_special_tokens: NAME{...} for a NAME among the
request's tools); the v7 array still read; malformed or unfinished calls as content — each parsed whole
and streamed alike (check_stream); and one request through the gateway, where the tools reach the parser."""

from __future__ import annotations

import json
import re

import openai
import pytest
from test_tool_parser_qwen3_coder import check_stream, random_fragments, stream_check, streamed_chat

from runtime import ServerArgs
from runtime.gateway.chat_output import ChatOutput
from runtime.gateway.server import serve_in_thread
from runtime.gateway.tool_parsers import create_tool_parser

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
         for n in ("get_weather", "add", "search")]
W, A = {"city": "Pa}ris", "q": "[ARGS]"}, {"a": 1, "b": [2.5, None]}
WJ, AJ = json.dumps(W), json.dumps(A)


def parsed(text: str, tools=TOOLS) -> tuple[str, list[tuple[str, dict]]]:
    out = check_stream(lambda: ChatOutput(None, create_tool_parser("mistral", tools)), text, raw_args=True)
    return out.content, [(c.function.name, json.loads(c.function.arguments)) for c in out.tool_calls()]


@pytest.mark.parametrize("text, content, calls", [
    (f"[TOOL_CALLS]get_weather[ARGS]{WJ}", "", [("get_weather", W)]),
    (f"Two calls.[TOOL_CALLS]get_weather[ARGS]{WJ}[TOOL_CALLS]add[ARGS]{AJ}", "Two calls.",
     [("get_weather", W), ("add", A)]),
    (f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{WJ}\nafter", "\nafter", [("get_weather", W)]),
    (f"[TOOL_CALLS]add{AJ}", "", [("add", A)]),  # vLLM's v11 reading: the name runs up to "{"
    (f"[TOOL_CALLS]unknown_tool[ARGS]{AJ}", "", [("unknown_tool", A)]),  # with its markers, any name is a call
    (f"get_weather{WJ}add{AJ}", "", [("get_weather", W), ("add", A)]),  # markers skipped as special tokens
    (f"  get_weather{WJ}\n add{AJ} Thanks", " Thanks", [("get_weather", W), ("add", A)]),
    (f'[TOOL_CALLS][{{"name": "add", "arguments": {AJ}}}]', "", [("add", A)]),  # the v7 array
    (f'[{{"name": "add", "arguments": {AJ}}}]', "", [("add", A)]),
])
def test_calls(text, content, calls):
    assert parsed(text) == (content, calls)


# The not-calls of test_not_calls_are_content that stream a call as far as it went (a number may grow, a
# JSON error stops it) before the finished message finds it is content.
STREAMED = {'[TOOL_CALLS]add[ARGS]{"a": tru}': [("add", '{"a": ')], '[TOOL_CALLS]add[ARGS]{"a": 1': [("add", '{"a": ')],
            'add{"a": 1': [("add", '{"a": ')]}


def stream_of(text: str) -> tuple[ChatOutput, list[tuple[str, str]]]:
    return stream_check(lambda: ChatOutput(None, create_tool_parser("mistral", TOOLS)), text, raw_args=True)


@pytest.mark.parametrize("text", [
    "[TOOL_CALLS]get weather[ARGS]{}", '[TOOL_CALLS]add[ARGS]{"a": tru}', "[TOOL_CALLS]add[ARGS][1, 2]",
    "[TOOL_CALLS]add[ARGS]", '[TOOL_CALLS]add[ARGS]{"a": 1', "[TOOL_CALLS]add[CALL_ID]x1", "[TOOL_CALLS]",
    "Sure. [TOOL_CALLS]{}", f"unknown{AJ}", f"Sure. add{AJ}",  # a bare call only opens the output
    "get_weather is the tool I would use", "[1, 2] is a list", 'add{"a": 1',
])
def test_not_calls_are_content(text):
    out, unsettled = stream_of(text)
    assert (out.content, out.tool_calls()) == (text, [])
    assert unsettled == STREAMED.get(text, [])


def test_a_call_after_settled_ones_may_fail_alone():
    good = f"[TOOL_CALLS]add[ARGS]{AJ}"
    for bad, streamed in [("[TOOL_CALLS]add[ARGS]{oops}", "{"), ('[TOOL_CALLS]add[ARGS]{"a": ', '{"a": ')]:
        out, unsettled = stream_of(good + bad)
        assert out.content == bad and [(c.function.name, json.loads(c.function.arguments))
                                       for c in out.tool_calls()] == [("add", A)]
        assert unsettled == [("add", streamed)]


def test_call_ids_fit_mistral_templates():
    """Mistral's chat templates refuse tool call ids in the history that are not 9 letters or digits."""
    ids = {create_tool_parser("mistral").new_call_id() for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 9 and i.isascii() and i.isalnum() for i in ids)
    assert create_tool_parser("hermes").new_call_id().startswith("call_")


def test_bare_calls_need_the_tools():
    assert parsed(f"add{AJ}", tools=None) == (f"add{AJ}", [])


def test_random_fragments():
    random_fragments("mistral", ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "add", "search", "{", "}", '"a"', ":", "1",
                                 "[", "]", ",", " ", "x", '{"name": "add", "arguments": {}}', "\n", '"'], TOOLS)


@pytest.fixture(scope="module")
def client(gw_engine):
    with serve_in_thread(gw_engine, ServerArgs(tool_call_parser="mistral"), port=0) as h:
        yield openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_through_the_gateway(client):
    """The tiny model writes a v11 call as text after skip_special_tokens dropped its markers: only the
    request's tool names make it a call."""
    kw = dict(model="llama", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS, max_tokens=200,
              temperature=0, extra_body={"regex": r'search\{"query": "[a-z]{1,6}"\}'})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    (tc,) = c.message.tool_calls
    assert tc.function.name == "search" and re.fullmatch("[a-z]{1,6}", json.loads(tc.function.arguments)["query"])
    content, _, calls = streamed_chat(client, **kw)
    assert content == "" and calls == {0: ["search", tc.function.arguments]}
