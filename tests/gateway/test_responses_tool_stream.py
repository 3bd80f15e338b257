"""A function call streamed on /v1/responses (--tool-call-parser hermes, stream=true) while the model writes
its arguments: the call's item opens once its name is whole, its arguments.delta events concatenate to
exactly its arguments, and nothing of it comes after its arguments.done and output_item.done — also when
one update of the text carries the call's last arguments piece and the text after the call (the message
that follows must not close the call before that piece landed)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from gw_helpers import http
from test_gw_responses_stream import named_events

from runtime import ServerArgs
from runtime.gateway.chat_output import ChatOutput
from runtime.gateway.responses_output import ResponseItems
from runtime.gateway.server import serve_in_thread
from runtime.gateway.tool_parsers import create_tool_parser

TOOLS = [{"type": "function", "name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "n": {"type": "integer"}}}}]
# A regex makes the random tiny model write a hermes call whose arguments end in a number (held back
# until the object closes), then text after the call.
CALL = (r'[A-Z][a-z]{1,6}\.\n<tool_call>\n\{"name": "search", "arguments": \{"query": "[a-z]{8,16}", '
        r'"n": [1-9][0-9]\}\}\n</tool_call>\nDone\.')
# Never matched, but the detokenizer holds back the text while its tail may begin it: from the "}" that
# ends the arguments to past "</tool_call>\n", so one update brings the last piece and the text after.
HOLD = '}}\n</tool_call>\nX'


def call_events(events: list[tuple[str, dict[str, Any]]]) -> tuple[str, list[str], str, str]:
    """(the call item's added arguments, its arguments deltas, the arguments its done event and its
    output_item.done carry), checking nothing of it comes after its done event."""
    (added,) = [d["item"] for n, d in events if n == "response.output_item.added" and d["item"]["type"] ==
                "function_call"]
    mine = [(n, d) for n, d in events if d.get("item_id") == added["id"] or d.get("item", {}).get("id") == added["id"]]
    names = [n for n, _ in mine]
    assert names[0] == "response.output_item.added" and names[-2:] == [
        "response.function_call_arguments.done", "response.output_item.done"], names
    assert set(names[1:-2]) <= {"response.function_call_arguments.delta"}
    deltas = [d["delta"] for n, d in mine[1:-2]]
    return added["arguments"], deltas, mine[-2][1]["arguments"], mine[-1][1]["item"]["arguments"]


@pytest.fixture(scope="module")
def hermes_url(gw_engine):
    with serve_in_thread(gw_engine, ServerArgs(tool_call_parser="hermes"), port=0) as h:
        yield h.url


@pytest.mark.parametrize("stop", [None, [HOLD]], ids=["plain", "last_piece_with_text_after"])
def test_call_arguments_stream_and_close_whole(hermes_url, stop):
    body = {"model": "llama", "input": "Hi", "tools": TOOLS, "max_output_tokens": 200, "temperature": 0,
            "regex": CALL, **({"stop": stop} if stop else {})}
    status, r = http(hermes_url + "/v1/responses", "POST", body)
    assert status == 200, r
    assert [o["type"] for o in r["output"]] == ["message", "function_call"]
    msg, call = r["output"]
    assert call["name"] == "search" and json.loads(call["arguments"])["n"] >= 10
    assert re.fullmatch(r"[A-Z][a-z]{1,6}\.\n\nDone\.", msg["content"][0]["text"])
    status, raw = http(hermes_url + "/v1/responses", "POST", {**body, "stream": True})
    assert status == 200, raw
    events = named_events(raw)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    added, deltas, done, item_done = call_events(events)
    assert added == "" and len(deltas) >= 2, "the arguments come in pieces"
    assert "".join(deltas) == done == item_done == call["arguments"]
    final = events[-1][1]["response"]
    assert events[-1][0] == "response.completed"
    assert [o["type"] for o in final["output"]] == ["message", "function_call", "message"]
    assert [o["arguments"] for o in final["output"] if o["type"] == "function_call"] == [call["arguments"]]
    assert "".join(o["content"][0]["text"] for o in final["output"] if o["type"] == "message") == \
        msg["content"][0]["text"]


def test_one_delta_with_a_calls_last_piece_and_the_text_after():
    """ResponseItems alone, on the ChatOutput deltas of a text fed up to inside the call's number, then
    past it: the call takes its last piece before the message after it opens."""
    text = 'Hi.\n<tool_call>\n{"name": "search", "arguments": {"n": 12}}\n</tool_call>\nDone.'
    out, items = ChatOutput(None, create_tool_parser("hermes")), ResponseItems()
    events = []
    for cut, final in [(text.index("12") + 1, False), (len(text), True)]:
        events += items.feed(out.update(text[:cut], final=final))
    events += items.finish(False)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == ['{"n": 12}']
    after = events[events.index(done[0]):]
    assert not [e for e in after if e.type == "response.function_call_arguments.delta"]
    assert [(i.kind, i.text) for i in items.items] == [("message", "Hi.\n"), ("function_call", '{"n": 12}'),
                                                       ("message", "\nDone.")]
