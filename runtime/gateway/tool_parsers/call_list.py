"""CallListParser: a JSON array of call objects, [{"name": ..., "arguments": {...}}, ...], starting at a
given index — Mistral's format after [TOOL_CALLS], and Shoal's own for tool_choice "required"."""

from __future__ import annotations

from runtime.gateway.tool_parsers.json_scan import CallSpan, scan_call, skip_ws


class CallListParser:
    """Not a ToolParser itself: the array scan the formats that use one share."""

    @staticmethod
    def scan(text: str, i: int) -> tuple[list[CallSpan], int | None]:
        """Calls of the array at text[i] ("["), and the index after its "]" (None while incomplete)."""
        calls: list[CallSpan] = []
        j = skip_ws(text, i + 1)
        while j < len(text):
            if text[j] == "]":
                return calls, j + 1
            if text[j] == ",":
                j = skip_ws(text, j + 1)
                continue
            if text[j] != "{":
                raise ValueError(f"expected a call object at {j}")
            call, end = scan_call(text, j)
            calls.append(call)
            if end is None:
                return calls, None
            j = skip_ws(text, end)
        return calls, None
