"""A tool call the model never finished (hermes' <tool_call> without the rest, Mistral's [TOOL_CALLS] array
left open, a Llama 3 object cut off, or a "call" whose JSON does not parse) is content, as vLLM answers:
the raw text, no tool call, the engine's finish_reason. Streamed, nothing of such a call goes out as a
tool-call delta: the held text comes as content at the end, so the deltas add up to the same message."""

from __future__ import annotations

import json
import random
import re

import openai
import pytest
from test_tool_parsers import TJ, WJ, W, _stream

from runtime import ServerArgs
from runtime.gateway.chat_output import ChatOutput
from runtime.gateway.server import serve_in_thread
from runtime.gateway.tool_parsers import create_tool_parser

CUT = '{"name": "tool2", "arguments": {"q": [1, 2'
# (format, text, content, calls): the text ends inside a call, or holds one whose JSON does not parse.
CASES = [
    ("hermes", f"Let me check.\n<tool_call>\n{CUT}", f"Let me check.\n<tool_call>\n{CUT}", []),
    ("hermes", "Checking <tool_call>", "Checking <tool_call>", []),
    ("hermes", f'<tool_call>\n{{"name": "weather", "arguments": {WJ}}}\n</tool_call>\n<tool_call>{CUT}',
     f"\n<tool_call>{CUT}", [("weather", W)]),
    ("hermes", '<tool_call>{"name": "weather", "arguments": {"city": tru}}</tool_call> ok',
     '<tool_call>{"name": "weather", "arguments": {"city": tru}}</tool_call> ok', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("mistral", f'Sure. [TOOL_CALLS][{{"name": "weather", "arguments": {WJ}}}, {CUT}',
     f'Sure. [TOOL_CALLS][{{"name": "weather", "arguments": {WJ}}}, {CUT}', []),
    ("mistral", f"[{CUT}", f"[{CUT}", []),
    ("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("llama3_json", f"<|python_tag|>{CUT}", f"<|python_tag|>{CUT}", []),
    ("llama3_json", f'{{"name": "weather", "parameters": {WJ}}}; {CUT}', f"; {CUT}", [("weather", W)]),
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_unfinished_call_is_content(fmt, text, content, calls):
    whole = ChatOutput(None, create_tool_parser(fmt))
    whole.update(text, final=True)
    assert whole.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls()] == calls
    rng = random.Random(7)
    for _ in range(5):
        s_content, _, s_calls = _stream(lambda: ChatOutput(None, create_tool_parser(fmt)), text, rng)
        assert s_content == content
        assert [s_calls[i] for i in sorted(s_calls)] == [(c.function.name, c.function.arguments)
                                                         for c in whole.tool_calls()]


def test_auto_calls_go_out_whole_once_settled():
    """hermes streams a call as one name delta and one arguments delta, once its object closed."""
    text = f'<tool_call>\n{{"name": "tool2", "arguments": {TJ}}}\n</tool_call>'
    out = ChatOutput(None, create_tool_parser("hermes"))
    sent = []
    for cut in range(1, len(text) + 1):
        sent += out.update(text[:cut], final=False).tool_calls
        if cut < text.index(TJ) + len(TJ) + 1:
            assert not sent, text[:cut]
    pieces = [(d.function.name if d.function.name else None, d.function.arguments) for d in sent]
    assert pieces == [("tool2", ""), (None, TJ)]


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
    content, tool_deltas, finishes = "", 0, []
    for chunk in hermes_client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            tool_deltas += len(ch.delta.tool_calls or [])
            finishes += [ch.finish_reason] if ch.finish_reason else []
    assert (content, tool_deltas, finishes) == (c.message.content, 0, [finish])


def test_finished_call_over_http_is_still_a_call(hermes_client):
    r = hermes_client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}],
                                              tools=TOOLS, max_tokens=80, temperature=0,
                                              extra_body={"regex": FINISHED})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "search"
    assert re.fullmatch(r"[A-Z][a-z]{1,6}\.\n", c.message.content)
