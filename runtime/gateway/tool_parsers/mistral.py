"""MistralToolParser: Mistral's calls after any content, in either of its tokenizer generations' formats —
up to v7 (Mistral 7B v0.3, Nemo, Small 3.1): [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], whose
calls settle when the array closes; v11+ (Small 3.2, Magistral, Devstral): [TOOL_CALLS]NAME[ARGS]{...}
once per call (v13 may put [CALL_ID]ID before [ARGS]), each settling when its object closes. What
follows the marker says which; vLLM decides by the tokenizer's version. The markers are control tokens,
which skip_special_tokens removes: an output that then starts with `[{"name"` is read as the v7 array,
and one that starts with NAME{ for a NAME among the request's tools as v11 calls (repeated without
markers). A call the output ends inside, or one whose arguments do not parse, is content
(ParsedOutput.unfinished)."""

from __future__ import annotations

import re
import secrets
import string

from runtime.gateway.tool_parsers.base import ParsedOutput, ToolParser, register_tool_parser
from runtime.gateway.tool_parsers.json_scan import CallSpan, ValueScans, held_prefix, scan_call_list, skip_ws

_MARKER, _ARGS, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_BARE_LIST = re.compile(r'\[\s*\{\s*"name"')
_BARE_LIST_PREFIX = '[{"name"'
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_ID = re.compile(r"[A-Za-z0-9]*")
_HOLD = "hold"
_ALNUM = string.ascii_letters + string.digits


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    streams_partial_calls = True

    def new_call_id(self) -> str:
        # Mistral's chat templates refuse a history whose tool call ids are not 9 letters or digits (vLLM's
        # MistralToolCall makes them so): an OpenAI-shaped id would break the conversation's next turn.
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out = ParsedOutput("")
        pos, bare = 0, True  # bare: calls without their markers may start at pos
        while True:
            if bare:
                at = skip_ws(text, pos)
                kind = self._bare(text, at, final, first=pos == 0)
                if kind == _HOLD:
                    return out
                if kind is not None:
                    try:
                        end = self._calls_at(out, text, pos, at, final)
                    except ValueError:  # not calls after all: content, and no more bare ones
                        bare = False
                        continue
                    if end is None:
                        return out
                    pos, bare = end, kind == "call"
                    continue
                bare = False
            start = text.find(_MARKER, pos)
            if start < 0:
                rest = text[pos:]
                out.content += rest if final else rest[:len(rest) - held_prefix(rest, (_MARKER,))]
                return out
            out.content += text[pos:start]
            j = skip_ws(text, start + len(_MARKER))
            if j >= len(text):
                return out.unfinished(text[start:], 0, final)
            try:
                end = self._calls_at(out, text, start, j, final)
            except ValueError:  # not calls after all: the marker and what follows are content
                out.content += text[start:j]
                pos = j
                continue
            if end is None:
                return out
            pos = end

    def _bare(self, text: str, at: int, final: bool, first: bool) -> str | None:
        """What starts at text[at] without a marker: "list" (v7 array, only at the output's start), "call"
        (NAME{ of one of the tools), _HOLD (the text ends before that is decided) or None (content)."""
        rest = text[at:at + 256]  # enough to decide (a name is at most 64 characters): no copy of the whole text
        if first:
            if _BARE_LIST.match(rest):
                return "list"
            if not final and _BARE_LIST_PREFIX.startswith(re.sub(r"\s+", "", rest)):
                return _HOLD
        names = [n + "{" for n in self.tool_names()]
        if any(rest.startswith(n) for n in names):
            return "call"
        if not final and (not rest or any(n.startswith(rest) for n in names)):
            return _HOLD
        return None

    def _calls_at(self, out: ParsedOutput, text: str, region: int, j: int, final: bool) -> int | None:
        """Reads the calls at text[j] into out (their raw text starts at region); the index after them, or
        None when the text ends inside them (out then took ParsedOutput.unfinished). ValueError: no calls."""
        if text[j] == "[":
            calls, end = scan_call_list(text, j, self.scans)
            out.calls += calls
            if end is None:
                out.unfinished(text[region:], len(calls), final)
            return end
        call, end = _compact_call(text, j, final, self.scans)
        if call is not None:
            out.calls.append(call)
        if end is None:
            out.unfinished(text[region:], int(call is not None), final)
        return end


def _compact_call(text: str, j: int, final: bool, scans: ValueScans) -> tuple[CallSpan | None, int | None]:
    """The v11 call NAME([CALL_ID]ID)?([ARGS])?{...} at text[j] (its span, with arguments as far as they
    go, None before they start) and the index after it (None while incomplete). ValueError: no call."""
    m = _NAME.match(text, j)
    if m is None:
        raise ValueError("a call's name must be 1-64 letters, digits, '_', '-' or '.'")
    name, k = m.group(), m.end()
    if k >= len(text):
        return None, None
    if text.startswith(_CALL_ID, k):
        k = _ID.match(text, k + len(_CALL_ID)).end()
        if k >= len(text):
            return None, None
    if text.startswith(_ARGS, k):
        k += len(_ARGS)
    elif not final and (_ARGS.startswith(text[k:]) or _CALL_ID.startswith(text[k:])):
        return None, None  # a marker still arriving
    k = skip_ws(text, k)
    if k >= len(text):
        return None, None
    if text[k] != "{":
        raise ValueError(f"expected the arguments object at {k}")
    scan = scans.at(text, k)
    end = scan.end
    if end is None:
        return CallSpan(name, text[k:], False, j, scan.stable(text) - k), None
    if not isinstance(scan.value(text), dict):  # a JSONDecodeError is a ValueError too
        raise ValueError("a call's arguments must be an object")
    return CallSpan(name, text[k:end], True, j), end
