"""MistralToolParser: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] after any content. [TOOL_CALLS]
is a control token, which skip_special_tokens removes: an output that then starts with `[{"name"` is
read as the calls too. The calls settle when their array closes: an output that ends inside it is
content, calls and all (ParsedOutput.unfinished)."""

from __future__ import annotations

import re

from runtime.gateway.tool_parsers.base import ParsedOutput, ToolParser, register_tool_parser
from runtime.gateway.tool_parsers.call_list import CallListParser
from runtime.gateway.tool_parsers.json_scan import held_prefix, skip_ws

_MARKER = "[TOOL_CALLS]"
_BARE = re.compile(r'\s*\[\s*\{\s*"name"')
_BARE_PREFIX = '[{"name"'


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = text.find(_MARKER)
        if start >= 0:
            content, j = text[:start], skip_ws(text, start + len(_MARKER))
        elif _BARE.match(text):
            content, j, start = "", skip_ws(text, 0), 0
        else:
            if final:
                return ParsedOutput(text)
            hold = held_prefix(text, (_MARKER,))
            if not text.strip() or _BARE_PREFIX.startswith(text.strip().replace(" ", "")):
                hold = len(text)  # may still become a bare call list
            return ParsedOutput(text[:len(text) - hold])
        if j >= len(text):
            return ParsedOutput(content).unfinished(text[start:], 0, final)
        if text[j] != "[":
            return ParsedOutput(text if final else content)
        try:
            calls, end = CallListParser.scan(text, j)
        except ValueError:
            return ParsedOutput(text)
        out = ParsedOutput(content, calls)
        if end is None:
            return out.unfinished(text[start:], len(calls), final)
        out.content += text[end:]
        return out
