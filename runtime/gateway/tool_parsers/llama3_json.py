"""Llama3JsonToolParser: Llama 3.1 / 3.2 JSON tool calls — {"name": ..., "parameters": {...}} objects,
optionally after <|python_tag|>, several separated by ";", with content before and after them. A call
the output ends inside is held back, then content (ParsedOutput.unfinished)."""

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
        tag = text.find(_TAG)
        m = _CALL.search(text, tag + len(_TAG) if tag >= 0 else 0)
        if m is None:
            body = text.replace(_TAG, "")
            return ParsedOutput(body if final else body[:len(body) - _held(body)])
        region = tag if 0 <= tag < m.start() else m.start()  # where the unfinished call's raw text starts
        out = ParsedOutput(text[:region])
        j = m.start()
        while True:
            try:
                call, end = scan_call(text, j, scans=self.scans)
            except ValueError:
                out.content += text[j:]
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
