"""CallListParser: a JSON array of call objects, [{"name": ..., "arguments": {...}}, ...], starting at a
given index — Mistral's format after [TOOL_CALLS], and Shoal's own for tool_choice "required"."""

from __future__ import annotations

from runtime.gateway.tool_parsers.json_scan import CallSpan, ValueScans, scan_call_list


class CallListParser:
    """Not a ToolParser itself: the array scan the formats that use one share."""

    @staticmethod
    def scan(text: str, i: int, scans: ValueScans | None = None) -> tuple[list[CallSpan], int | None]:
        """Calls of the array at text[i] ("["), and the index after its "]" (None while incomplete); scans: a
        parser's ValueScans, so each update of a stream goes on from where the last one stopped."""
        return scan_call_list(text, i, scans)
