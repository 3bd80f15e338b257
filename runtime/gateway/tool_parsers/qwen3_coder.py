"""Qwen3CoderToolParser: Qwen3-Coder / Qwen3.5 XML-style calls, after any content —
<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>, several in a row.
A VALUE is bare text (code, often): it ends at a </parameter> that the next parameter, </function> or
</tool_call> follows, so a literal </parameter> inside it stays text; a missing </parameter> ends at
</function></tool_call> or at the next <parameter=NAME> of the function's schema not yet given. Each
value becomes JSON by its schema type in the request's tools (param_text), and the call's arguments are
that object serialized, as vLLM answers. A call settles at its </function>; one the output ends inside
is held back, then content (ParsedOutput.unfinished). A bare <function=...> without <tool_call> is a
call too (vLLM's fallback)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from runtime.gateway.tool_parsers import param_text
from runtime.gateway.tool_parsers.base import ParsedOutput, ToolParser, register_tool_parser
from runtime.gateway.tool_parsers.json_scan import CallSpan, held_prefix, skip_ws

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_FUNC, _FUNC_END = "<function=", "</function>"
_PARAM, _PARAM_END = "<parameter=", "</parameter>"
_BAD_NAME_CHARS = frozenset("{}<>\"' \t\r\n")


class _Pending(Exception):
    """The text ends before the call does: wait for more (or, once none comes, it is content). at: where
    the text stops being certain inside a parameter value (what is before it is the value's), else -1."""

    def __init__(self, at: int):
        super().__init__(at)
        self.at = at


class _NotACall(Exception):
    """What follows the marker is not the format: the marker and that text are content."""


@register_tool_parser("qwen3_xml")  # vLLM's other parser of the same format
@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    streams_partial_calls = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        if not text.startswith(self._text):
            self._resume.clear()
        self._text = text
        out = ParsedOutput("")
        pos = 0
        while True:
            start = _next_marker(text, pos)
            if start < 0:
                rest = text[pos:]
                out.content += rest if final else rest[:len(rest) - held_prefix(rest, (_OPEN, _FUNC))]
                return out
            out.content += text[pos:start]
            j = skip_ws(text, start + len(_OPEN)) if text.startswith(_OPEN, start) else start
            try:
                if not text.startswith(_FUNC, j):
                    if j >= len(text) or (not final and _may_become(text, j, (_FUNC,))):
                        raise _Pending(-1)
                    raise _NotACall
                call, end = self._function(text, j, final)
            except _Pending:
                return out.unfinished(text[start:], 0, final)
            except _NotACall:  # the marker is text; what follows it is read again
                pos = j if j > start else start + 1
                out.content += text[start:pos]
                continue
            if call is not None:
                out.calls.append(call)
            if end is None:
                return out.unfinished(text[start:], int(call is not None), final)
            k = skip_ws(text, end)
            if text.startswith(_CLOSE, k):
                pos = k + len(_CLOSE)
            elif not final and (k >= len(text) or _may_become(text, k, (_CLOSE,))):
                return out  # the closing tag is still coming
            else:
                pos = k  # no </tool_call> (a bare <function=...>, or the model forgot it): what follows is content

    def __init__(self, tools: Sequence[dict[str, Any]] | None = None):
        super().__init__(tools)
        # Each finished parameter's '"P": V' by (function, parameter, where its value starts), with the value
        # text it encodes: a stream parses the whole text on every update, and typing a long value
        # (json.loads, ast.literal_eval) on each would cost the whole text per update.
        self._fragments: dict[tuple[str, str, int], tuple[str, str]] = {}
        # Where the end of the parameter value starting at each index is looked for next: every "<" before it
        # was read as the value's text. A value full of "<" (HTML, code) is not read again from its start on
        # every update. Valid while each text goes on from the last one (_text); a text that does not (the
        # text before changed, not only grew) starts over.
        self._resume: dict[int, int] = {}
        self._text = ""

    def _function(self, text: str, j: int, final: bool) -> tuple[CallSpan | None, int | None]:
        """The call <function=NAME>...</function> at text[j]: its span and the index after </function>. While
        the text ends inside it: (None, None) before its name and first parameter's are whole, else the call
        unsettled, its arguments what of them may go out already (_stable_arguments)."""
        name, i = _tag_name(text, j + len(_FUNC))
        schemas = self.tool_properties(name)
        # Each parameter read, as its JSON fragment. One given twice keeps its first value, so what a stream
        # sent of it stands (vLLM's dict keeps the last: only a repeated parameter reads differently).
        done: dict[str, str] = {}
        pname, v = None, -1  # the parameter being read, and where its value starts
        try:
            while True:
                pname = None
                i = skip_ws(text, i)
                if text.startswith(_FUNC_END, i):
                    i += len(_FUNC_END)
                    break
                if text.startswith(_CLOSE, i):  # </function> left out: </tool_call> ends the call too
                    break
                if not text.startswith(_PARAM, i):
                    if i >= len(text) or (not final and _may_become(text, i, (_FUNC_END, _PARAM, _CLOSE))):
                        raise _Pending(-1)
                    raise _NotACall
                pname, v = _tag_name(text, i + len(_PARAM))
                if v >= len(text):
                    raise _Pending(v)
                if text[v] == "\n":
                    v += 1
                end, i = self._value_end(text, v, final, set(schemas) - set(done) - {pname})
                if pname not in done:
                    done[pname] = self._fragment(name, pname, v, _trim(text[v:end]), schemas.get(pname))
        except _Pending as p:
            if p.at < 0 or pname is None:
                if not done:
                    return None, None  # the name waits for a first <parameter=P>: "<function=x> prose" is no call
                pname, v = None, p.at
            partial = _stable_arguments(done, schemas, pname, text[v:max(p.at, v)] if pname else "")
            return CallSpan(name, partial, False, j), None
        return CallSpan(name, "{" + ", ".join(done.values()) + "}", True, j), i  # json.dumps of the typed values

    def _value_end(self, text: str, v: int, final: bool, unseen: set[str]) -> tuple[int, int]:
        """_value_end going on from where the last update's scan of the value at text[v] stopped. A final
        text's scan is not kept: what it read as value text a text that goes on may not (a marker cut off)."""
        try:
            end, i = _value_end(text, v, self._resume.get(v, v), final, unseen)
        except _Pending as p:
            if not final and p.at >= v:
                self._resume[v] = p.at
            raise
        if not final:
            self._resume[v] = end  # the "<" that ends it: deciding it again is one step
        return end, i

    def _fragment(self, name: str, pname: str, v: int, value: str, schema: Any) -> str:
        """'"P": V' of the finished parameter pname whose text value starts at text[v], typed by its schema
        once (again only if that text changed: a text that does not just grow)."""
        key = (name, pname, v)
        hit = self._fragments.get(key)
        if hit is None or hit[0] != value:
            typed = json.dumps(param_text.convert(value, schema), ensure_ascii=False)
            hit = self._fragments[key] = (value, f"{json.dumps(pname, ensure_ascii=False)}: {typed}")
        return hit[1]


def _trim(value: str) -> str:
    """A parameter's text less the newline before its end tag."""
    return value[:-1] if value.endswith("\n") else value


def _stable_arguments(done: dict[str, str], schemas: dict, pname: str | None, value: str) -> str:
    """The start of the call's arguments (json.dumps of the typed parameters: '{"P": V, ...}') that no later
    text changes: the parameters read so far (done: their fragments); then the one being read (pname, its
    text so far) as its key and, for a parameter whose value is its text as is, that text as an open JSON
    string, less a last newline (the value's end drops it). A parameter given again adds nothing."""
    parts = list(done.values())
    if pname is not None and pname not in done:
        parts.append(f"{json.dumps(pname, ensure_ascii=False)}: ")
        if param_text.is_plain_text(schemas.get(pname)):
            parts[-1] += json.dumps(_trim(value), ensure_ascii=False)[:-1]
    return "{" + ", ".join(parts)


def _next_marker(text: str, pos: int) -> int:
    """Where the next call starts: <tool_call>, or a bare <function= (-1: none)."""
    found = [i for i in (text.find(_OPEN, pos), text.find(_FUNC, pos)) if i >= 0]
    return min(found) if found else -1


def _may_become(text: str, i: int, markers: tuple[str, ...]) -> bool:
    """Whether the text ends inside one of markers starting at text[i] (a tail too short to decide)."""
    return any(len(text) - i < len(m) and m.startswith(text[i:]) for m in markers)


def _tag_name(text: str, i: int) -> tuple[str, int]:
    """The NAME of <function=NAME> / <parameter=NAME> starting at text[i], and the index after its '>'."""
    end = text.find(">", i)
    name = text[i:] if end < 0 else text[i:end]
    if any(c in _BAD_NAME_CHARS for c in name):
        raise _NotACall  # not an identifier (an unrendered template, prose): not the format
    if end < 0:
        raise _Pending(-1)
    if not name:
        raise _NotACall
    return name, end + 1


def _value_end(text: str, v: int, i: int, final: bool, unseen: set[str]) -> tuple[int, int]:
    """Where the parameter value starting at text[v] ends, and where the function body goes on from, looking
    from text[i] on (the text between v and i is known to be the value's: no "<" there ends it).
    The first of: </parameter> followed by another parameter, </function> or </tool_call>; </function>
    followed by </tool_call> (its </parameter> left out); a line that opens a parameter of the schema
    not given yet (unseen; its </parameter> left out). Each needs what follows it, so the text may end
    before it is decided (_Pending)."""
    while True:
        c = text.find("<", i)
        if c < 0:
            raise _Pending(len(text))
        if text.startswith(_PARAM_END, c):
            a = skip_ws(text, c + len(_PARAM_END))
            if text.startswith((_PARAM, _FUNC_END, _CLOSE), a):
                return c, a
            if a >= len(text) or (not final and _may_become(text, a, (_PARAM, _FUNC_END, _CLOSE))):
                raise _Pending(c)
        elif text.startswith(_FUNC_END, c):
            a = skip_ws(text, c + len(_FUNC_END))
            if text.startswith(_CLOSE, a) or (final and a >= len(text)):
                return c, c
            if a >= len(text) or (not final and _may_become(text, a, (_CLOSE,))):
                raise _Pending(c)
        elif text.startswith(_PARAM, c) and c > v and text[c - 1] == "\n" and unseen:
            end = text.find(">", c + len(_PARAM))
            if end < 0:
                if not final:
                    raise _Pending(c)
            elif text[c + len(_PARAM):end] in unseen:
                return c, c
        elif not final and _may_become(text, c, (_PARAM_END, _FUNC_END, _PARAM)):
            raise _Pending(c)  # the text ends inside what may become one of them
        i = c + 1

