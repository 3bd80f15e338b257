"""Tool-call arguments stream as the model writes them (hermes, llama3_json, mistral v7 and v11, qwen3_coder):
a call's first delta carries its index, id, type and name (arguments ""), later ones argument pieces that
concatenate to exactly the non-streamed call's arguments — for every chunking of the same text (one char at
a time, random pieces, the tiny tokenizer's tokens). Content is the same as non-streamed; a call that never
settles (cut off, or its JSON breaks) leaves its raw text as content in both, and in the stream only the
call as far as it went (never a piece a later token would take back: a number still growing, half an
escape, a JSON error are held)."""

from __future__ import annotations

import ast
import json
import random
import sys
from collections.abc import Callable

import pytest
from tiny_models import make_tokenizer

from runtime.gateway.chat_output import ChatOutput
from runtime.gateway.tool_parsers import create_tool_parser, param_text, qwen3_coder
from runtime.gateway.tool_parsers.json_prefix import stable_prefix_end

CODE = 'def f(a, b):\n    """Adds."""\n    return {"sum": a + b, "tab": "\\t", "uni": "é ☃"}  # </tool_call>\n' * 3
ARGS = json.dumps({"path": "src/app.py", "content": CODE, "mode": 420, "ratio": -1.5e-3, "ok": True,
                   "tags": ["a", None, {"deep": [1, 2]}]}, ensure_ascii=False)
SMALL = '{"q": "cats", "n": 12}'
PROPS = {"path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
         "opts": {"type": "object"}, "note": {"type": ["string", "null"]}}
TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": PROPS}}}]


def _qwen(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# (format, text, the non-streamed calls' names): content around, one long call, several calls.
TEXTS = [
    ("hermes", f'Writing it.\n<tool_call>\n{{"name": "write_file", "arguments": {ARGS}}}\n</tool_call>\n'
               f'<tool_call>\n{{"name": "search", "arguments": {SMALL}}}\n</tool_call>\nDone.', ["write_file", "search"]),
    ("llama3_json", f'<|python_tag|>{{"name": "write_file", "parameters": {ARGS}}}; '
                    f'{{"name": "search", "parameters": {SMALL}}}', ["write_file", "search"]),
    ("mistral", f'Sure. [TOOL_CALLS][{{"name": "write_file", "arguments": {ARGS}}}, '
                f'{{"name": "search", "arguments": {SMALL}}}]', ["write_file", "search"]),
    ("mistral", f"[TOOL_CALLS]write_file[ARGS]{ARGS}[TOOL_CALLS]search[CALL_ID]a1B2c3D4e[ARGS]{SMALL}",
     ["write_file", "search"]),
    ("qwen3_coder", "Let me write it.\n" + _qwen("write_file", path="src/app.py", content=CODE, mode="420",
                                                 opts="{'a': [1, 2]}", note="None")
     + "\n" + _qwen("write_file", path="b.txt", content="x < y </parameter> z\n") + "\nok", ["write_file"] * 2),
]


def _factory(fmt: str) -> Callable[[], ChatOutput]:
    return lambda: ChatOutput(None, create_tool_parser(fmt, TOOLS))


def _chunkings(text: str, token_ends: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(len(text))
    out = [list(range(1, len(text) + 1))]
    for hi in (4, 17):
        cuts, cut = [], 0
        while cut < len(text):
            cut = min(len(text), cut + rng.randint(1, hi))
            cuts.append(cut)
        out.append(cuts)
    if token_ends:
        out.append(token_ends)
    return out


def stream(factory: Callable[[], ChatOutput], text: str, cuts: list[int]) -> tuple[ChatOutput, str, dict]:
    """Feeds text[:cut] for each cut, then the whole as final: (the output, the streamed content, the
    streamed calls {index: {id, name, args, pieces}}), checking each delta's shape on the way: a call's
    index comes once a chunk, its first entry with id, type, name and its arguments so far (maybe none)."""
    out, content, calls = factory(), "", {}
    for cut, final in [(c, False) for c in cuts] + [(len(text), True)]:
        d = out.update(text[:cut], final=final)
        content += d.content
        assert len({tc.index for tc in d.tool_calls}) == len(d.tool_calls), "an index once a chunk"
        for tc in d.tool_calls:
            if tc.index not in calls:
                assert tc.index == len(calls) and tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "args": tc.function.arguments,
                                   "pieces": int(tc.function.arguments != "")}
            else:
                assert not tc.id and not tc.function.name, "id, type and name go out once, first"
                assert tc.function.arguments
                calls[tc.index]["args"] += tc.function.arguments
                calls[tc.index]["pieces"] += 1
    return out, content, calls


def check(fmt: str, text: str, token_ends: list[int] | None = None) -> list[dict]:
    """Every chunking streams the non-streamed message: same content; the calls that settle, in order,
    with their exact arguments; a call that went out but never settled has its raw text in the content.
    Returns the one-char-at-a-time stream's settled calls."""
    whole = _factory(fmt)()
    whole.update(text, final=True)
    want = [(c.function.name, c.function.arguments) for c in whole.tool_calls()]
    first = None
    for cuts in _chunkings(text, token_ends):
        out, content, calls = stream(_factory(fmt), text, cuts)
        assert content == whole.content, cuts[:3]
        ids = {c.id for c in out.tool_calls()}
        kept = [c for _, c in sorted(calls.items()) if c["id"] in ids]
        assert [(c["name"], c["args"]) for c in kept] == want
        for c in calls.values():
            if c["id"] not in ids:
                assert c["name"] in whole.content  # dropped: its text is content, as non-streamed
        first = first or kept
    return first


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("fmt, text, names", TEXTS, ids=["hermes", "llama3", "mistral_v7", "mistral_v11", "qwen3"])
def test_arguments_stream_in_pieces(fmt, text, names, tokenizer):
    token_ends = [e for _, e in tokenizer(text, return_offsets_mapping=True)["offset_mapping"] if e > 0]
    calls = check(fmt, text, token_ends)
    assert [c["name"] for c in calls] == names
    assert calls[0]["pieces"] > 20, "a long call's arguments come in many deltas"
    for c in calls:
        json.loads(c["args"])


def test_name_goes_out_before_the_arguments_end():
    """The first delta comes as soon as the name is whole; pieces follow while the arguments are written."""
    for fmt, text, _ in TEXTS:
        out, seen_name, pieces_before_end = _factory(fmt)(), None, 0
        end = text.index("src/app.py") + 200  # inside the long content
        for cut in range(1, end):
            for tc in out.update(text[:cut], final=False).tool_calls:
                if tc.function.name:
                    seen_name = seen_name or cut
                else:
                    pieces_before_end += 1
        assert seen_name is not None and seen_name < text.index("src/app.py"), fmt
        assert pieces_before_end > 10, fmt


def test_held_back_pieces():
    """Pieces a later character could still change wait: a growing number, a literal, half an escape; a
    JSON error stops the stream of that call where it is."""
    assert stable_prefix_end('{"a": 12', 0) == 6 and stable_prefix_end('{"a": 12,', 0) == 9
    assert stable_prefix_end('{"a": tr', 0) == 6 and stable_prefix_end('{"a": true}', 0) == 11
    assert stable_prefix_end('{"a": "x\\', 0) == 8 and stable_prefix_end('{"a": "x\\u00', 0) == 8
    assert stable_prefix_end('{"a": "x\\q"}', 0) == 8 and stable_prefix_end('{"a": tru}', 0) == 6
    assert stable_prefix_end('{"a": [1, 2] } tail', 0) == len('{"a": [1, 2] }')
    # qwen3_coder: a string value streams as it is written, a typed one once it ended
    text = "<tool_call>\n<function=write_file>\n<parameter=content>\nab\ncd\n</param"
    out = _factory("qwen3_coder")()
    d = out.update(text, final=False)
    assert [tc.function.arguments for tc in d.tool_calls] == ['{"content": "ab\\ncd']
    d = out.update(text + "eter>\n<parameter=mode>\n42", final=False)
    assert [tc.function.arguments for tc in d.tool_calls] == ['", "mode": ']
    d = out.update(text + "eter>\n<parameter=mode>\n42\n</parameter>\n</function>", final=True)
    assert [tc.function.arguments for tc in d.tool_calls] == ["42}"]


CUT = f'Let me.\n<tool_call>\n{{"name": "write_file", "arguments": {ARGS}}}\n</tool_call>'
BROKEN = [
    ("hermes", '<tool_call>{"name": "weather", "arguments": {"city": tru}}</tool_call> ok'),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": 1}} junk <tool_call>{"name": "b", "arguments": {}}'
               "</tool_call>"),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": 1}, "k" 5}</tool_call><tool_call>{"name": "b", '
               '"arguments": {"z": [3]}}</tool_call>'),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": tru}[TOOL_CALLS]add[ARGS]{"a": 2}'),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": 2}} x'),
    ("llama3_json", '{"name": "a", "parameters": {"x": "1"}}; {"name": "b", "parameters": {"y": 0x1}}'),
    ("hermes", '<tool_call>{"name": "", "arguments": {"x": 1}}</tool_call>'),  # an empty name: no call
    ("mistral", '[TOOL_CALLS][{"name": "", "arguments": {}}]'),
    ("qwen3_coder", "<tool_call>\n<function=search>\ngarbage\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=path>\nx\n</parameter>\njunk</function>"
                    + _qwen("write_file", path="y")),
]


@pytest.mark.parametrize("fmt, text", BROKEN)
def test_malformed_calls(fmt, text):
    check(fmt, text)


@pytest.mark.parametrize("fmt, text, _", TEXTS + [("hermes", CUT, None)], ids=["hermes", "llama3", "mistral_v7",
                                                                                  "mistral_v11", "qwen3", "cut"])
def test_truncated_anywhere(fmt, text, _):
    """The output cut off at any point (finish_reason length): no crash, content as non-streamed, settled
    calls alike, an unsettled one kept as far as it went, never with a piece its full text would not have."""
    full = _factory(fmt)()
    full.update(text, final=True)
    final_args = [c.function.arguments for c in full.tool_calls()]
    for n in range(0, len(text), 7):
        check_cut = text[:n]
        whole = _factory(fmt)()
        whole.update(check_cut, final=True)
        out, content, calls = stream(_factory(fmt), check_cut, list(range(1, n + 1, 5)) or [n])
        assert content == whole.content
        for c in calls.values():
            assert any(a.startswith(c["args"]) for a in final_args), (n, c)


REPEATED = [  # (format, text, the call's name and arguments: each key's first value)
    ("hermes", '<tool_call>{"name": "a", "name": "b", "arguments": {"x": 1}}</tool_call>', ("a", '{"x": 1}')),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": 1}, "arguments": {"y": 2}}</tool_call>',
     ("a", '{"x": 1}')),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": 1}, "parameters": {"y": 2}}</tool_call>',
     ("a", '{"x": 1}')),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}, "name": "b"}]', ("a", '{"x": 1}')),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}, "name": "b"}', ("a", '{"x": 1}')),
    ("qwen3_coder", _qwen("write_file", path="a", content="b", mode="1").replace("content", "path"),
     ("write_file", '{"path": "a", "mode": 1}')),
]


@pytest.mark.parametrize("fmt, text, want", REPEATED)
def test_a_key_given_twice_keeps_its_first_value(fmt, text, want):
    """A model that gives a call's name, its arguments (or a qwen3_coder parameter) twice: the first one
    counts, in the stream (which sent it before the second came) and in the finished message alike."""
    assert [(c["name"], c["args"]) for c in check(fmt, text)] == [want]


def test_llama3_content_that_may_become_a_call_waits():
    """'{' then whitespace then the start of "name" may still become a call: held back, never sent as
    content the finished message then leaves out."""
    text = 'Call: {\n"name": "a", "parameters": {"x": 1}}'
    whole = _factory("llama3_json")()
    whole.update(text, final=True)
    assert whole.content == "Call: "
    assert [(c["name"], c["args"]) for c in check("llama3_json", text)] == [("a", '{"x": 1}')]
    out = _factory("llama3_json")()
    assert out.update('Call: { \n "na', final=False).content == "Call: "
    assert out.update('Call: { \n "nab', final=True).content == '{ \n "nab'


def test_first_entry_carries_the_first_piece():
    """A call whose name and first arguments come in one update is one entry of that chunk (OpenAI and vLLM
    never repeat an index in a chunk): id, type, name and the arguments so far."""
    for fmt, text in [("hermes", '<tool_call>{"name": "a", "arguments": {"x": "ab'),
                      ("mistral", '[TOOL_CALLS]a[ARGS]{"x": "ab'),
                      ("qwen3_coder", "<tool_call>\n<function=a>\n<parameter=x>\nab")]:
        d = _factory(fmt)().update(text, final=False)
        assert [(tc.index, tc.function.name, tc.function.arguments) for tc in d.tool_calls] == \
            [(0, "a", '{"x": "ab')], fmt


LONG = json.dumps({"content": CODE * 12, **{f"k{i}": [i, -1.5, "v", None, True] for i in range(150)}})
LONG_TEXTS = [("hermes", f'<tool_call>\n{{"name": "write_file", "arguments": {LONG}}}\n</tool_call>'),
              ("llama3_json", f'{{"name": "write_file", "parameters": {LONG}}}'),
              ("mistral", f'[TOOL_CALLS][{{"name": "write_file", "arguments": {LONG}}}]'),
              ("mistral", f"[TOOL_CALLS]write_file[ARGS]{LONG}")]


@pytest.mark.parametrize("fmt, text", LONG_TEXTS, ids=["hermes", "llama3", "mistral_v7", "mistral_v11"])
def test_an_update_scans_only_new_text(fmt, text):
    """Each update of a stream parses the whole text again; the JSON scans go on from where the last one
    stopped, so an update's work (Python lines run in the parsers) does not grow with the text before it."""
    limit = 1000  # lines one update may run (~350 at most now; scanning all the text before ran ~20k at the end)
    out, lines = _factory(fmt)(), 0

    def trace(frame, event, arg):
        nonlocal lines
        if "tool_parsers" not in frame.f_code.co_filename or lines > limit:
            return None
        lines += 1
        return trace

    worst, old = 0, sys.gettrace()
    try:
        for cut in range(4, len(text), 4):
            lines = 0
            sys.settrace(trace)
            out.update(text[:cut], final=False)
            sys.settrace(old)
            worst = max(worst, lines)
    finally:
        sys.settrace(old)
    assert worst <= limit, worst
    out.update(text, final=True)
    assert [c.function.arguments for c in out.tool_calls()] == [LONG]


def test_qwen3_types_each_parameter_once(monkeypatch):
    """A finished typed parameter (a long Python-literal object) is converted once, not on every update
    that follows while later parameters stream."""
    calls = []
    convert = param_text.convert
    monkeypatch.setattr(param_text, "convert", lambda text, schema: calls.append(text) or convert(text, schema))
    opts = repr({f"k{i}": [i, "v" * 10, None, True] for i in range(40)})
    text = _qwen("write_file", opts=opts, mode="7", content=CODE * 4, path="a.py")
    out = _factory("qwen3_coder")()
    for cut in range(4, len(text), 4):
        out.update(text[:cut], final=False)
    out.update(text, final=True)
    (call,) = out.tool_calls()
    assert json.loads(call.function.arguments)["opts"] == ast.literal_eval(opts)
    assert len(calls) <= 4 + 2, "each parameter once (a value the text changed under: again)"


def test_qwen3_an_update_scans_only_new_value_text(monkeypatch):
    """A parameter value full of "<" (HTML): each update's search for where the value ends goes on from where
    the last one stopped, so what it reads does not grow with the value (it read all of it, every "<", before)."""
    scanned: list[int] = []
    value_end = qwen3_coder._value_end

    def counting(text: str, v: int, i: int, final: bool, unseen: set[str]) -> tuple[int, int]:
        try:
            end, nxt = value_end(text, v, i, final, unseen)
        except qwen3_coder._Pending as p:
            scanned.append(max(p.at, i) - i)
            raise
        scanned.append(end - i)
        return end, nxt

    monkeypatch.setattr(qwen3_coder, "_value_end", counting)
    html = '<div class="a"><b>x</b> &lt; <br/></div>\n' * 500
    text = _qwen("write_file", path="a.html", content=html, mode="7")
    out, worst = _factory("qwen3_coder")(), 0
    for cut in range(4, len(text), 4):
        scanned.clear()
        out.update(text[:cut], final=False)
        worst = max(worst, sum(scanned))
    assert worst <= 40, worst  # the 4 new characters and a marker they may end inside (~20k before)
    out.update(text, final=True)
    (call,) = out.tool_calls()
    assert json.loads(call.function.arguments) == {"path": "a.html", "content": html, "mode": 7}


@pytest.mark.parametrize("fmt, pieces", [
    ("qwen3_coder", ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>",
                     "write_file", "path", "mode", ">", "\n", " ", "3", "x", "<"]),
    ("mistral", ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "write_file", "{", "}", '"a"', ":", "1", ",", " ", "[",
                 "]", '"name"', '"arguments"', '"x', "\\", "tru", "e"]),
    ("hermes", ["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", '"f"', "1", ",", " ", "[",
                "]", '"x', "\\", "tru", "e", "<"]),
])
def test_random_fragments(fmt, pieces):
    rng = random.Random(fmt)
    for _ in range(150):
        check(fmt, "".join(rng.choice(pieces) for _ in range(rng.randint(1, 16))))
