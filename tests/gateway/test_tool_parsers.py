"""Tool-call and reasoning parsers on fixed text in each supported format: single and parallel calls,
text before / between / after them, and the streaming property — feeding the text in every split
gives deltas that concatenate to the non-streamed message."""

from __future__ import annotations

import json
import random
import re

import pytest

from runtime.gateway.chat_output import ChatOutput
from runtime.gateway.reasoning_parsers import create_reasoning_parser, reasoning_parser_names
from runtime.gateway.tool_parsers import create_tool_parser, tool_parser_names
from runtime.gateway.tool_parsers.named_call import NamedCallParser
from runtime.gateway.tool_parsers.required_list import RequiredListParser

W = {"city": "Paris", "note": "a } and a \" quote, {x}"}
T = {"q": [1, 2.5, {"deep": None}], "ok": True}
WJ, TJ = json.dumps(W), json.dumps(T)

CASES = {
    "hermes": [
        (f'<tool_call>\n{{"name": "weather", "arguments": {WJ}}}\n</tool_call>', "", [("weather", W)]),
        (f'Let me check.\n<tool_call>\n{{"name": "weather", "arguments": {WJ}}}\n</tool_call>\n'
         f'<tool_call>\n{{"name": "tool2", "arguments": {TJ}}}\n</tool_call>\nDone!',
         "Let me check.\n\n\nDone!", [("weather", W), ("tool2", T)]),
        ("No calls here, just <tool text.", "No calls here, just <tool text.", []),
    ],
    "llama3_json": [
        (f'{{"name": "weather", "parameters": {WJ}}}', "", [("weather", W)]),
        (f'<|python_tag|>{{"name": "weather", "parameters": {WJ}}}; {{"name": "tool2", "parameters": {TJ}}}',
         "", [("weather", W), ("tool2", T)]),
        (f'Sure: {{"name": "weather", "parameters": {WJ}}} hope that helps', "Sure:  hope that helps",
         [("weather", W)]),
        ("The answer is {x} and 42.", "The answer is {x} and 42.", []),
    ],
    "mistral": [
        (f'[TOOL_CALLS][{{"name": "weather", "arguments": {WJ}}}]', "", [("weather", W)]),
        (f'Calling two. [TOOL_CALLS] [{{"name": "weather", "arguments": {WJ}}}, {{"name": "tool2", "arguments": {TJ}}}]'
         ' after', "Calling two.  after", [("weather", W), ("tool2", T)]),
        (f'[{{"name": "weather", "arguments": {WJ}}}]', "", [("weather", W)]),  # [TOOL_CALLS] skipped as special
        ("[1, 2] is a list", "[1, 2] is a list", []),
    ],
}


def _stream(output_factory, text: str, rng: random.Random):
    """Feeds text in random pieces; returns (content, {index: (name, arguments)}) from the deltas and
    the final ChatOutput."""
    out = output_factory()
    content, reasoning, calls = "", "", {}
    cut = 0
    while cut < len(text):
        cut = min(len(text), cut + rng.randint(1, 4))
        d = out.update(text[:cut], final=False)
        content, reasoning = content + d.content, reasoning + d.reasoning
        for tc in d.tool_calls:
            name, args = calls.get(tc.index, (None, ""))
            if tc.function.name:
                assert name is None and args == "", "the name comes first, once"
                name = tc.function.name
            calls[tc.index] = (name, args + (tc.function.arguments or ""))
    d = out.update(text, final=True)
    content, reasoning = content + d.content, reasoning + d.reasoning
    for tc in d.tool_calls:
        name, args = calls.get(tc.index, (tc.function.name, ""))
        calls[tc.index] = (name, args + (tc.function.arguments or ""))
    return content, reasoning, calls


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_parser_fixed_text_and_stream(fmt):
    assert fmt in tool_parser_names()
    rng = random.Random(0)
    for text, content, expected in CASES[fmt]:
        whole = ChatOutput(None, create_tool_parser(fmt))
        whole.update(text, final=True)
        assert whole.content == content, text
        got = [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls()]
        assert got == expected, text
        ids = [c.id for c in whole.tool_calls()]  # OpenAI's shape; Mistral's: 9 letters or digits
        assert all(re.fullmatch("[A-Za-z0-9]{9}", i) if fmt == "mistral" else i.startswith("call_") for i in ids)
        for _ in range(5):  # several random splits: the deltas always add up to the whole
            s_content, _, s_calls = _stream(lambda: ChatOutput(None, create_tool_parser(fmt)), text, rng)
            assert s_content == whole.content
            assert [s_calls[i] for i in sorted(s_calls)] == [(c.function.name, c.function.arguments)
                                                             for c in whole.tool_calls()]


def test_required_and_named_outputs():
    text = f'[{{"name": "weather", "parameters": {WJ}}}, {{"name": "tool2", "parameters": {TJ}}}]'
    out = ChatOutput(None, RequiredListParser())
    out.update(text, final=True)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.tool_calls()] == [("weather", W), ("tool2", T)]
    assert out.content == ""
    out = ChatOutput(None, NamedCallParser("weather"))
    out.update(WJ, final=True)
    assert [(c.function.name, c.function.arguments) for c in out.tool_calls()] == [("weather", WJ)]
    _, _, calls = _stream(lambda: ChatOutput(None, NamedCallParser("weather")), WJ, random.Random(1))
    assert calls == {0: ("weather", WJ)}


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", "<think>\nLet me think.\n</think>\n\nParis.", "\nLet me think.\n", "Paris."),
    ("qwen3", "Paris, no thinking.", "", "Paris, no thinking."),
    ("qwen3", "<think>cut off mid tho", "cut off mid tho", ""),
    ("deepseek-r1", "Let me think.</think>Paris.", "Let me think.", "Paris."),
    ("deepseek-r1", "<think>Hmm.</think>\nParis.", "Hmm.", "Paris."),
    ("deepseek-r1", "never closed", "never closed", ""),
])
def test_reasoning_parsers(name, text, reasoning, content):
    assert name in reasoning_parser_names()
    out = ChatOutput(create_reasoning_parser(name), None)
    out.update(text, final=True)
    assert (out.reasoning, out.content) == (reasoning, content)
    s_content, s_reasoning, _ = _stream(lambda: ChatOutput(create_reasoning_parser(name), None), text,
                                        random.Random(2))
    assert (s_reasoning, s_content) == (reasoning, content)


def test_reasoning_then_tool_call():
    text = f'<think>I need the weather.</think>\n<tool_call>\n{{"name": "weather", "arguments": {WJ}}}\n</tool_call>'
    factory = lambda: ChatOutput(create_reasoning_parser("qwen3"), create_tool_parser("hermes"))  # noqa: E731
    out = factory()
    out.update(text, final=True)
    assert out.reasoning == "I need the weather." and out.content == ""
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.tool_calls()] == [("weather", W)]
    content, reasoning, calls = _stream(factory, text, random.Random(3))
    assert (content, reasoning) == ("", "I need the weather.") and calls == {0: ("weather", WJ)}


def test_unknown_parser_names():
    with pytest.raises(ValueError, match="hermes"):
        create_tool_parser("nope")
    with pytest.raises(ValueError, match="qwen3"):
        create_reasoning_parser("nope")
