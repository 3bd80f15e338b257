"""Scanning JSON inside model output that is still growing: where a value ends (string- and
escape-aware bracket matching), and a tool-call object's name and raw arguments as far as they go.
The arguments stay the model's own text (never re-serialized), so the pieces a stream sends
concatenate to exactly what the finished answer holds."""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"


@dataclass(slots=True)
class CallSpan:
    """One tool call seen in the text: its name once complete, its arguments' raw JSON text so far."""

    name: str | None
    arguments: str
    # Settled: the call's object closed with a name and arguments that parse, and nothing later in the
    # text can undo it (a format whose calls sit in one array settles them when the array closes).
    complete: bool


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i], or None if the text stops inside it."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: ends at a delimiter (the text may still grow it)
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def scan_call(text: str, i: int, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[CallSpan, int | None]:
    """The call object {"name": ..., "arguments": {...}} starting at text[i], as far as the text goes; and
    the index after it, or None while it is incomplete. ValueError when it is no call: not an object, a
    name that is not a string, arguments that are not JSON, or an object that closes without a name (a
    call without arguments gets "{}")."""
    if i >= len(text) or text[i] != "{":
        raise ValueError(f"expected a call object at {i}")
    call = CallSpan(None, "", False)
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
        end = value_end(text, j)
        if key in arg_keys:
            call.arguments = text[j:end] if end is not None else text[j:]
        if end is None:
            return call, None
        value = json.loads(text[j:end])  # a JSONDecodeError is a ValueError: not a call after all
        if key == "name":
            if not isinstance(value, str):
                raise ValueError(f"a call's name must be a string, got {text[j:end]}")
            call.name = value
        j = skip_ws(text, end)
    return call, None


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of text that could still grow into one of markers (held back)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:n]):
                best = max(best, n)
                break
    return best
