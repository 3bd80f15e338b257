"""StablePrefix: how much of a JSON value the model is still writing may go out in a stream now — the
longest start of it that is valid JSON so far and that no later character can undo. A string's characters go
out as they come (long code or file contents stream); a number or true/false/null is held until the
character after it shows where it ends (a "1" may become "12", a "tru" may become "trux"), as is an escape
until it is whole. Syntax the finished value would fail on (json.loads) stops the prefix there, so a call
whose arguments turn out not to be JSON has sent nothing past its first error. The text only grows from one
update to the next, so each advance goes on from where the last stopped (inside an open string too): a
stream's scanning costs the length of its text once, not once per update."""

from __future__ import annotations

import re

_WS = " \t\r\n"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
# A string's body as far as it is valid and whole: json.loads refuses a raw control character or an unknown
# escape; a backslash the text ends in, or a \u with fewer than four hex digits, waits for more.
_BODY = re.compile(r'(?:[^"\\\x00-\x1f]+|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')

# What the scanner expects next.
_VALUE, _FIRST_VALUE, _FIRST_KEY, _KEY, _COLON, _AFTER = range(6)


class StablePrefix:
    """The sendable prefix of the JSON value starting at text[start] of a text that keeps growing."""

    __slots__ = ("start", "good", "scanned", "_stack", "_want", "_j", "_in_string")

    def __init__(self, start: int):
        self.start = start
        self.good = start  # end (exclusive) of what may be sent: at most where the value ends
        self.scanned = 0  # characters scanned so far, all advances together (the work a stream costs)
        self._stack: list[str] = []
        self._want = _VALUE
        self._j = start  # where the next advance goes on: a token's start (an error stays there), or in a string
        self._in_string = False

    def advance(self, text: str) -> int:
        """The sendable end in text, which extends every text this was advanced on before."""
        stack, want, j, good, in_string = self._stack, self._want, self._j, self.good, self._in_string
        i, n, begin = self.start, len(text), j
        while not (want == _AFTER and not stack):
            if in_string:  # a key's or a value's (want says which), from where its valid text stopped
                k = _BODY.match(text, j).end()
                j = good = k
                if k >= n or text[k] != '"':
                    break  # open, or at an escape still arriving (or not valid: it stays here)
                in_string, j = False, k + 1
                good = j
                want = _COLON if want in (_FIRST_KEY, _KEY) else _AFTER
                continue
            if j >= n:
                break
            c = text[j]
            if c in _WS and j > i:
                j += 1
                good = j
                continue
            if want == _AFTER:
                if c == ",":
                    want = _KEY if stack[-1] == "{" else _VALUE
                elif c == ("}" if stack[-1] == "{" else "]"):
                    stack.pop()
                else:
                    break
                j += 1
                good = j
                continue
            if want in (_FIRST_KEY, _KEY, _COLON):
                if want == _FIRST_KEY and c == "}":
                    stack.pop()
                    want, j = _AFTER, j + 1
                elif want == _COLON:
                    if c != ":":
                        break
                    want, j = _VALUE, j + 1
                elif c == '"':
                    in_string, j = True, j + 1
                else:
                    break
                good = j
                continue
            # a value (or, first in an array, its close)
            if want == _FIRST_VALUE and c == "]":
                stack.pop()
                want, j = _AFTER, j + 1
            elif c in "{[":
                stack.append(c)
                want, j = (_FIRST_KEY if c == "{" else _FIRST_VALUE), j + 1
            elif c == '"':
                in_string, j = True, j + 1
            else:
                end = _scalar_end(text, j)
                if end is None:
                    break  # growing, or not valid: scanned again from its start next time (it is short)
                want, j = _AFTER, end
            good = j
        self._want, self._j, self.good, self._in_string = want, j, good, in_string
        self.scanned += j - begin
        return good


def stable_prefix_end(text: str, i: int) -> int:
    """End (exclusive) of the part of the JSON value starting at text[i] that may be sent now (one scan of a
    text that will not grow; a stream keeps its StablePrefix)."""
    return StablePrefix(i).advance(text)


def _scalar_end(text: str, i: int) -> int | None:
    """End of the number or literal at text[i] once a delimiter shows it whole and it is valid; else None."""
    j = i
    if text[i] in _NUMBER_CHARS:
        while j < len(text) and text[j] in _NUMBER_CHARS:
            j += 1
        ok = _NUMBER.fullmatch(text, i, j) is not None
    else:
        while j < len(text) and text[j].isalpha():
            j += 1
        ok = text[i:j] in _LITERALS
    return j if ok and j < len(text) else None
