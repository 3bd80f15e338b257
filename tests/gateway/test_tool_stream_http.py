"""Streamed tool calls through the gateway's chat route (--tool-call-parser hermes, stream=true): the OpenAI
SDK sees the call's id, type and name first, then its arguments in several pieces that concatenate to the
non-streamed call's arguments; a call the output is cut off inside keeps the non-streamed content."""

from __future__ import annotations

import openai
import pytest

from runtime import ServerArgs
from runtime.gateway.server import serve_in_thread

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "n": {"type": "integer"}}}}}]
# A regex makes the random tiny model write a hermes call with a long-ish string argument.
CALL = (r'[A-Z][a-z]{1,6}\.\n<tool_call>\n\{"name": "search", "arguments": \{"query": "[a-z]{12,24} [a-z]{12,24}", '
        r'"n": [1-9]\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def client(gw_engine):
    with serve_in_thread(gw_engine, ServerArgs(tool_call_parser="hermes"), port=0) as h:
        yield openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _streamed(client: openai.OpenAI, **kw) -> tuple[str, list, list[str]]:
    content, deltas, finishes = "", [], []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            deltas += ch.delta.tool_calls or []
            finishes += [ch.finish_reason] if ch.finish_reason else []
    return content, deltas, finishes


def test_arguments_stream_in_pieces(client):
    kw = dict(model="llama", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS, max_tokens=200,
              temperature=0, extra_body={"regex": CALL})
    c = client.chat.completions.create(**kw).choices[0]
    (tc,) = c.message.tool_calls
    assert c.finish_reason == "tool_calls" and tc.function.name == "search"
    content, deltas, finishes = _streamed(client, **kw)
    assert content == c.message.content and finishes == ["tool_calls"]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name) == (0, "function", "search")
    assert first.id and all(d.index == 0 and not d.id and not d.function.name for d in rest)
    assert len(rest) > 3, "the arguments come in several deltas"
    # the first entry carries the arguments written by then (likely none yet), the rest follow in pieces
    assert first.function.arguments + "".join(d.function.arguments for d in rest) == tc.function.arguments


def test_cut_off_call(client):
    kw = dict(model="llama", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS, max_tokens=30,
              temperature=0, extra_body={"regex": CALL})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None and "<tool_call>" in c.message.content
    content, deltas, finishes = _streamed(client, **kw)
    assert content == c.message.content and finishes == ["length"]
    args = "".join(d.function.arguments or "" for d in deltas)
    assert all(d.index == 0 for d in deltas) and args in c.message.content  # the call as far as it went
