"""Scanning JSON inside model output that is still growing: where a value ends (string- and
escape-aware bracket matching), and a tool-call object's name and raw arguments as far as they go.
The arguments stay the model's own text (never re-serialized), so the pieces a stream sends
concatenate to exactly what the finished answer holds. A stream parses its whole text again on every
update: a parser keeps its output's ValueScans, so each update scans only the text that is new."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from runtime.gateway.tool_parsers.json_prefix import StablePrefix

_WS = " \t\r\n"
_STRING_BODY = re.compile(r'(?:[^"\\]+|\\.)*', re.S)  # lenient: where a string ends, not whether it is valid
_STRUCTURE = re.compile(r'["{}\[\]]')
_UNREAD = object()


@dataclass(slots=True)
class CallSpan:
    """One tool call seen in the text: its name once complete, its arguments' raw JSON text so far."""

    name: str | None
    arguments: str
    # Settled: the call's object closed with a name and arguments that parse, and nothing later in the
    # text can undo it (a format whose calls sit in one array settles them when the array closes).
    complete: bool
    # Where the call starts in the parsed text: which call it is from one parse to the next, for a stream
    # (-1: the format does not say; its calls are then told apart by their order).
    start: int = -1
    # How much of arguments a stream may send before the call settles (StablePrefix: a number still
    # growing, half an escape, a syntax error are held); None: all of it.
    stable: int | None = None


class ValueScan:
    """The JSON value starting at text[start] of a text that keeps growing: where it ends, how much of it
    may stream (StablePrefix), and what it parses to — each advance going on from where the last stopped."""

    __slots__ = ("start", "end", "prefix", "_depth", "_j", "_in_string", "_seen", "_value")

    def __init__(self, start: int):
        self.start = start
        self.end: int | None = None  # (exclusive) once the value closed
        self.prefix = StablePrefix(start)
        self._depth = 0
        self._j = start  # where the next advance goes on
        self._in_string = False
        # The text seen from start on (to the value's end, once known): a text that does not go on from it
        # (the text before changed, not only grew) gets a new scan.
        self._seen = ""
        self._value: Any = _UNREAD

    def extends(self, text: str) -> bool:
        return text.startswith(self._seen, self.start)

    def advance(self, text: str) -> int | None:
        """End (exclusive) of the value in text, or None if the text stops inside it."""
        if self.end is not None:
            return self.end
        i, j, n = self.start, self._j, len(text)
        if i >= n:
            return None
        if text[i] not in '"{[':  # a number, true, false or null: ends at a delimiter (the text may still grow it)
            k = i
            while k < n and text[k] not in ",}] \t\r\n":
                k += 1
            self.end = k if k < n else None
            self._seen = text[i:k + 1]  # with the delimiter that ends it
            return self.end
        depth, in_string = self._depth, self._in_string
        if j == i and text[i] == '"':
            in_string, j = True, i + 1
        while j < n:
            if in_string:
                k = _STRING_BODY.match(text, j).end()
                if k >= n or text[k] != '"':  # open (or a backslash the text ends in)
                    j = k
                    break
                in_string, j = False, k + 1
                if depth == 0:
                    self.end = j
                    break
                continue
            m = _STRUCTURE.search(text, j)
            if m is None:
                j = n
                break
            j = m.end()
            c = m.group()
            if c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    self.end = j
                    break
        self._depth, self._j, self._in_string = depth, j, in_string
        self._seen = text[i:self.end]  # (the prefix may have looked as far as the text goes)
        return self.end

    def stable(self, text: str) -> int:
        """How far the value may stream (StablePrefix.advance), as an index into text."""
        return self.prefix.advance(text)

    def value(self, text: str) -> Any:
        """The closed value, parsed once (json.JSONDecodeError, a ValueError, when it is not JSON)."""
        if self._value is _UNREAD:
            assert self.end is not None
            self._value = json.loads(text[self.start:self.end])
        return self._value


class ValueScans:
    """One output's ValueScans by where their values start (a parser keeps one per output)."""

    def __init__(self) -> None:
        self._at: dict[int, ValueScan] = {}

    def at(self, text: str, i: int) -> ValueScan:
        """The scan of the value at text[i], advanced to the end of text; a new one where the text no longer
        goes on from what an earlier one scanned (the text before it changed)."""
        scan = self._at.get(i)
        if scan is None or not scan.extends(text):
            scan = self._at[i] = ValueScan(i)
        scan.advance(text)
        return scan


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    j = _STRING_BODY.match(text, i + 1).end()
    return j + 1 if j < len(text) and text[j] == '"' else None


def scan_call(text: str, i: int, arg_keys: tuple[str, ...] = ("arguments", "parameters"),
              scans: ValueScans | None = None) -> tuple[CallSpan, int | None]:
    """The call object {"name": ..., "arguments": {...}} starting at text[i], as far as the text goes; and
    the index after it, or None while it is incomplete. ValueError when it is no call: not an object, a
    name that is not a non-empty string, arguments that are not JSON, or an object that closes without a name (a
    call without arguments gets "{}"). scans: the output's, so that a stream scans each value once.
    A key given twice keeps its first value (the first of arg_keys given stands for the arguments): what
    a stream sent from the first is never taken back. vLLM's json.loads keeps the last instead; only an
    object with a repeated key reads differently."""
    if i >= len(text) or text[i] != "{":
        raise ValueError(f"expected a call object at {i}")
    scans = scans if scans is not None else ValueScans()
    call = CallSpan(None, "", False, i)
    have_args = False
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            if call.name is None:
                raise ValueError("a call object without a name")
            call.arguments = call.arguments or "{}"
            call.complete = True
            return call, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        key_end = _string_end(text, j) if text[j] == '"' else None
        if key_end is None:
            return call, None
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return call, None
        if text[j] != ":":
            raise ValueError(f"expected ':' after key {key!r}")
        j = skip_ws(text, j + 1)
        scan = scans.at(text, j)
        end = scan.end
        if key in arg_keys and not have_args:
            have_args = True
            call.arguments = text[j:end] if end is not None else text[j:]
            call.stable = None if end is not None else scan.stable(text) - j
        if end is None:
            return call, None
        value = scan.value(text)  # a JSONDecodeError is a ValueError: not a call after all
        if key == "name" and call.name is None:
            if not isinstance(value, str) or not value:  # OpenAI's function.name is never empty
                raise ValueError(f"a call's name must be a non-empty string, got {text[j:end]}")
            call.name = value
        j = skip_ws(text, end)
    return call, None


def scan_call_list(text: str, i: int, scans: ValueScans | None = None) -> tuple[list[CallSpan], int | None]:
    """Calls of the array [{call}, ...] at text[i] ("["), and the index after its "]" (None while
    incomplete); scans as for scan_call."""
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
        call, end = scan_call(text, j, scans=scans)
        calls.append(call)
        if end is None:
            return calls, None
        j = skip_ws(text, end)
    return calls, None


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of text that could still grow into one of markers (held back)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:n]):
                best = max(best, n)
                break
    return best
