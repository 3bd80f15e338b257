"""HermesToolParser: Qwen2.5 / Qwen3 / Hermes — each call is <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
with text before, between and after the calls. A call the output ends inside (no closing brace: the
model ran out of tokens or stopped) is held back while text may come, and is content, marker and all,
once none will."""

from __future__ import annotations

from runtime.gateway.tool_parsers.base import ParsedOutput, ToolParser, register_tool_parser
from runtime.gateway.tool_parsers.json_scan import held_prefix, scan_call, skip_ws

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    streams_partial_calls = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out = ParsedOutput("")
        pos = 0
        while True:
            start = text.find(_OPEN, pos)
            if start < 0:
                rest = text[pos:]
                out.content += rest if final else rest[:len(rest) - held_prefix(rest, (_OPEN,))]
                return out
            out.content += text[pos:start]
            j = skip_ws(text, start + len(_OPEN))
            if j >= len(text):
                return out.unfinished(text[start:], 0, final)
            try:
                call, end = scan_call(text, j, scans=self.scans)
            except ValueError:  # not a call after all: the marker and what follows are content
                out.content += text[start:j]
                pos = j
                continue
            out.calls.append(call)
            if end is None:
                return out.unfinished(text[start:], 1, final)
            k = skip_ws(text, end)
            if text.startswith(_CLOSE, k):
                pos = k + len(_CLOSE)
            elif not final and _CLOSE.startswith(text[k:]):
                return out  # the closing tag is still coming
            else:
                pos = k  # no closing tag (the model forgot it): what follows is content
