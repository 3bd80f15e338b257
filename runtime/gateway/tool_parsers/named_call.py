"""NamedCallParser: the output of a named tool_choice, which the function's parameter schema shapes: the
whole text is that one call's arguments."""

from __future__ import annotations

from runtime.gateway.tool_parsers.base import ParsedOutput, ToolParser
from runtime.gateway.tool_parsers.json_scan import CallSpan


class NamedCallParser(ToolParser):
    streams_partial_calls = True  # the grammar shapes the call: its arguments stream as they come

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", [CallSpan(self.name, text, final)])
