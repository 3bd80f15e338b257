"""Llama3JsonToolParser: Llama 3.1 / 3.2 JSON tool calls — {"name": ..., "parameters": {...}} objects,
optionally after <|python_tag|>, several separated by ";", with content before and after them. The first
such call opens the call region (its tag, if one comes right before it, with it); what follows the region's
calls is content. A <|python_tag|> that opens no call (prose or a built-in tool's code follows, or its call
never settles) is content as written, as vLLM answers (its content is then the model's text). A call the
output ends inside is held back, then content (ParsedOutput.unfinished)."""

from __future__ import annotations

import re

from runtime.gateway.tool_parsers.base import ParsedOutput, ToolParser, register_tool_parser
from runtime.gateway.tool_parsers.json_scan import held_prefix, scan_call, skip_ws

_TAG = "<|python_tag|>"
_CALL = re.compile(r'\{\s*"name"\s*:')
# A tail of content that may still become the start of a call (_CALL's text before its colon): held back.
_CALL_START = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?\Z')


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    streams_partial_calls = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out = ParsedOutput("")
        pos = 0
        while True:
            tag = text.find(_TAG, pos)
            m = _CALL.search(text, pos, tag if tag >= 0 else len(text))
            if m is not None:
                region = start = m.start()
            elif tag < 0:
                rest = text[pos:]
                out.content += rest if final else rest[:len(rest) - _held(rest)]
                return out
            else:
                start = skip_ws(text, tag + len(_TAG))
                region = tag
                if _CALL.match(text, start) is None:
                    if not final and (start >= len(text) or _CALL_START.match(text, start)):
                        out.content += text[pos:tag]
                        return out  # the tag may still open a call
                    out.content += text[pos:tag + len(_TAG)]  # it opens none: content; a call may come later
                    pos = tag + len(_TAG)
                    continue
            out.content += text[pos:region]
            return self._calls(text, region, start, final, out)

    def _calls(self, text: str, region: int, j: int, final: bool, out: ParsedOutput) -> ParsedOutput:
        """The ";"-separated calls from text[j] on (region: where their raw text starts, the tag's start if
        one opened them), and the content after them."""
        while True:
            try:
                call, end = scan_call(text, j, scans=self.scans)
            except ValueError:  # not a call after all: its raw text (from the tag or ";" before it) is content
                out.content += text[region:]
                return out
            out.calls.append(call)
            if end is None:
                return out.unfinished(text[region:], 1, final)
            k = skip_ws(text, end)
            if k < len(text) and text[k] == ";":
                region, k = end, skip_ws(text, k + 1)
                if k >= len(text):
                    return out.unfinished(text[region:], 0, final)
                if text[k] == "{":
                    j = k
                    continue
            elif k >= len(text) and not final:
                return out  # a ";" and another call may follow
            out.content += text[end:]
            return out


def _held(body: str) -> int:
    """Length of the tail of body that may still become a call's start (or the tag): held back."""
    brace = body.rfind("{")
    start = _CALL_START.match(body, brace) if brace >= 0 else None
    return max(held_prefix(body, (_TAG,)), len(body) - brace if start else 0)
