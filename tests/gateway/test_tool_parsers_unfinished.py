"""A tool call the model never finished (hermes' <tool_call> without the rest, Mistral's [TOOL_CALLS] array
left open, a Llama 3 object cut off, or a "call" whose JSON does not parse) is content, as vLLM answers:
the raw text, no tool call, the engine's finish_reason. Streamed, a call goes out once its name is whole and
its arguments as far as they are sure (a stream cannot take them back); the call's raw text comes as content
as well, so the content deltas add up to the same content and the calls that settle to the same calls."""

from __future__ import annotations

import json
import re

import openai
import pytest
from test_tool_parser_qwen3_coder import stream_check
from test_tool_parsers import TJ, WJ, W

from runtime import ServerArgs
from runtime.gateway.chat_output import ChatOutput
from runtime.gateway.server import serve_in_thread
from runtime.gateway.tool_parsers import create_tool_parser

CUT = '{"name": "tool2", "arguments": {"q": [1, 2'
CUT_SENT = ("tool2", '{"q": [1, ')  # what streams of CUT's call: the 2 may still grow
# (format, text, content, calls, streamed): the text ends inside a call, or holds one whose JSON does not
# parse; streamed: the calls that went out in the stream but are content in the finished message.
CASES = [
    ("hermes", f"Let me check.\n<tool_call>\n{CUT}", f"Let me check.\n<tool_call>\n{CUT}", [], [CUT_SENT]),
    ("hermes", "Checking <tool_call>", "Checking <tool_call>", [], []),
    ("hermes", f'<tool_call>\n{{"name": "weather", "arguments": {WJ}}}\n</tool_call>\n<tool_call>{CUT}',
     f"\n<tool_call>{CUT}", [("weather", W)], [CUT_SENT]),
    ("hermes", '<tool_call>{"name": "weather", "arguments": {"city": tru}}</tool_call> ok',
     '<tool_call>{"name": "weather", "arguments": {"city": tru}}</tool_call> ok', [], [("weather", '{"city": ')]),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', [], []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", [], []),
    # the array never closed: its first call streamed whole, yet the message keeps none of them
    ("mistral", f'Sure. [TOOL_CALLS][{{"name": "weather", "arguments": {WJ}}}, {CUT}',
     f'Sure. [TOOL_CALLS][{{"name": "weather", "arguments": {WJ}}}, {CUT}', [], [("weather", WJ), CUT_SENT]),
    ("mistral", f"[{CUT}", f"[{CUT}", [], [CUT_SENT]),
    ("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", [], []),
    ("llama3_json", f"<|python_tag|>{CUT}", f"<|python_tag|>{CUT}", [], [CUT_SENT]),
    ("llama3_json", f'{{"name": "weather", "parameters": {WJ}}}; {CUT}', f"; {CUT}", [("weather", W)], [CUT_SENT]),
]


@pytest.mark.parametrize("fmt, text, content, calls, streamed", CASES)
def test_unfinished_call_is_content(fmt, text, content, calls, streamed):
    whole, unsettled = stream_check(lambda: ChatOutput(None, create_tool_parser(fmt)), text, raw_args=True)
    assert whole.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls()] == calls
    assert unsettled == streamed


def test_auto_calls_stream_name_then_arguments():
    """hermes sends a call's name once it is whole, before its arguments begin, then the arguments in
    pieces as they are written, each extending the last."""
    text = f'<tool_call>\n{{"name": "tool2", "arguments": {TJ}}}\n</tool_call>'
    out = ChatOutput(None, create_tool_parser("hermes"))
    named_at, pieces = None, []
    for cut in range(1, len(text) + 1):
        for d in out.update(text[:cut], final=False).tool_calls:
            if d.function.name:
                assert named_at is None and not pieces and d.function.arguments == ""
                named_at = cut
            else:
                pieces.append((cut, d.function.arguments))
    assert named_at is not None and named_at <= text.index(TJ)
    assert "".join(p for _, p in pieces) == TJ and len(pieces) > 5
    assert pieces[0][0] < text.index(TJ) + len(TJ), "arguments stream before their object closed"


@pytest.fixture(scope="module")
def hermes_client(gw_engine):
    with serve_in_thread(gw_engine, ServerArgs(tool_call_parser="hermes"), port=0) as h:
        yield openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)


TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}]
# A regex makes the random model write a hermes call and end (the grammar's end is EOS) before closing it.
UNFINISHED = r'[A-Z][a-z]{1,6}\.\n<tool_call>\n\{"name": "search", "arguments": \{"query": "[a-z]{1,6}'
FINISHED = UNFINISHED + r'"\}\}\n</tool_call>'


@pytest.mark.parametrize("regex, max_tokens, finish", [(UNFINISHED, 80, "stop"), (FINISHED, 30, "length")])
def test_unfinished_call_over_http(hermes_client, regex, max_tokens, finish):
    kw = dict(model="llama", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS, max_tokens=max_tokens,
              temperature=0, extra_body={"regex": regex})
    r = hermes_client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == finish and c.message.tool_calls is None
    assert "<tool_call>" in c.message.content
    assert finish == "length" or re.fullmatch(regex, c.message.content)
    content, deltas, finishes = "", [], []
    for chunk in hermes_client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            deltas += ch.delta.tool_calls or []
            finishes += [ch.finish_reason] if ch.finish_reason else []
    assert (content, finishes) == (c.message.content, [finish])
    # the call went out as far as it went (whole name, sure arguments); its text is in the content too
    assert finish == "length" or (deltas and deltas[0].function.name == "search" and deltas[0].id)
    assert all(d.index == 0 and (d is deltas[0] or not d.function.name) for d in deltas)
    # (how far: up to the last update before the end, which comes with the last token or after it; how many
    # tokens an update holds depends on the host's load, so only a prefix of the arguments' text is sure)
    args = "".join(d.function.arguments or "" for d in deltas)
    assert args in content and (finish == "length" or content.split('"arguments": ', 1)[1].startswith(args))


def test_finished_call_over_http_is_still_a_call(hermes_client):
    r = hermes_client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}],
                                              tools=TOOLS, max_tokens=80, temperature=0,
                                              extra_body={"regex": FINISHED})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "search"
    assert re.fullmatch(r"[A-Z][a-z]{1,6}\.\n", c.message.content)
