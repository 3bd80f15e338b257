"""llama3_json and <|python_tag|>: the tag opens the call right after it (whitespace between) and goes with
it once that call settles; a tag that opens no call (prose or a built-in tool's code after it, or a call
that never settles) is content as the model wrote it, as vLLM answers (content is the model's text when no
call parses). Streamed content is the non-streamed content for every chunking, wherever tags, calls and
prose fall (a seeded fuzz)."""

from __future__ import annotations

import json
import random

import pytest
from test_tool_stream_parsers import _factory, check

TAG = "<|python_tag|>"
A = '{"name": "a", "parameters": {"x": 1}}'
B = '{"name": "b", "parameters": {}}'
# (text, the non-streamed content, the calls' names)
CASES = [
    (TAG + A, "", ["a"]),
    (f"{TAG} \n{A}", "", ["a"]),
    (f"Let me look.{TAG}{A} Done.", "Let me look. Done.", ["a"]),
    (f"{TAG}{A}; {B}", "", ["a", "b"]),
    (f"{A} {TAG}", f" {TAG}", ["a"]),  # a call before the tag is a call
    (f"{TAG}hi {A}", f"{TAG}hi ", ["a"]),  # the tag opens no call: content; the call after it is one
    (f"{TAG}{TAG}{A}", TAG, ["a"]),
    (TAG, TAG, []),
    (f'{TAG}brave_search.call(query="x")', f'{TAG}brave_search.call(query="x")', []),
    (f'{TAG}{{"name": "a", "parameters": {{"x": tru}}}} ok', f'{TAG}{{"name": "a", "parameters": {{"x": tru}}}} ok',
     []),
    (f'{TAG} {{"name": "a", "parameters": {{"x": [1', f'{TAG} {{"name": "a", "parameters": {{"x": [1', []),
    # a later call that breaks: its raw text, from the ";" on, is content
    (f'{A}; {{"name": "b", "parameters": {{"y": 0x1}}}}', '; {"name": "b", "parameters": {"y": 0x1}}', ["a"]),
]


@pytest.mark.parametrize("text, content, names", CASES)
def test_python_tag(text, content, names):
    whole = _factory("llama3_json")()
    whole.update(text, final=True)
    assert whole.content == content
    assert [c.function.name for c in whole.tool_calls()] == names
    for c in whole.tool_calls():
        json.loads(c.function.arguments)
    check("llama3_json", text)


def test_a_tag_waits_until_what_follows_decides():
    """A tag (or a piece of one) and the whitespace after it are held while a call may still follow, then
    sent as content once something else does."""
    out = _factory("llama3_json")()
    assert out.update("Hi <|python_", final=False).content == "Hi "
    assert out.update(f"Hi {TAG} \n", final=False).content == ""
    assert out.update(f"Hi {TAG} \n{{ ", final=False).content == ""
    assert out.update(f"Hi {TAG} \n{{ x", final=False).content == f"{TAG} \n{{ x"


# Whole calls and broken ones, pieces of calls, tags and prose; each text is cut off at a random point too.
SEGMENTS = [TAG, TAG, A, B, A, '{"name": "c", "parameters": {"s": "a \\" } ; {x}"}}', '{"name": "d", "parameters": [1}}',
            '{"name": "e"}', '{"name": 3}', '{ "name" :', "{", '{"na', '"name": ', "}", ";", "; ", " ", "\n", "Sure: ",
            "x", '"', "\\", "<|python", "_tag|>"]


def test_random_text_streams_as_it_reads():
    """Random mixes of tags, calls and prose, whole and cut off: the same content and calls streamed (every
    chunking) as non-streamed."""
    rng = random.Random(20261128)
    for _ in range(300):
        text = "".join(rng.choice(SEGMENTS) for _ in range(rng.randint(1, 8)))
        check("llama3_json", text[:rng.randint(1, len(text))] if rng.random() < 0.3 else text)
