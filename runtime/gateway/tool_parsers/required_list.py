"""RequiredListParser: the output of tool_choice "required", which Shoal's own grammar shapes as
[{"name": ..., "parameters": {...}}, ...] — nothing else, so no content."""

from __future__ import annotations

from runtime.gateway.tool_parsers.base import ParsedOutput, ToolParser
from runtime.gateway.tool_parsers.call_list import CallListParser
from runtime.gateway.tool_parsers.json_scan import skip_ws


class RequiredListParser(ToolParser):
    streams_partial_calls = True  # the grammar shapes the call: its arguments stream as they come

    def parse(self, text: str, final: bool) -> ParsedOutput:
        j = skip_ws(text, 0)
        if j >= len(text):
            return ParsedOutput("")
        calls, _ = CallListParser.scan(text, j, self.scans)
        return ParsedOutput("", calls)
