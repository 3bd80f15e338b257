"""PythonicToolParser: Llama 3.2 / Llama 4 (and others) pythonic calls — the output is a Python list of calls
with keyword arguments, [get_weather(city="Paris"), add(a=1, b=2.5)], optionally wrapped in Llama 4's
<|python_start|>...<|python_end|>. As in vLLM the list must open the output (text before a bare list is
no call: "see [f(x=1)]" is prose); after <|python_start|> it may follow content, and text after the list
is content. The list is read with ast (never evaluated): only literals as arguments (strings, numbers,
True/False/None and JSON's true/false/null, lists, tuples, dicts), anything else makes the whole output
content, as vLLM answers. The calls settle when the list closes; an output that ends inside it is
content (ParsedOutput.unfinished)."""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from runtime.gateway.tool_parsers.base import ParsedOutput, ToolParser, register_tool_parser
from runtime.gateway.tool_parsers.json_scan import CallSpan, held_prefix, skip_ws

_START, _END = "<|python_start|>", "<|python_end|>"
_NAMED_LITERALS = {"true": True, "false": False, "null": None}


@register_tool_parser("llama4_pythonic")  # vLLM's name for Llama 4, whose <|python_start|> this reads too
@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        start, j = 0, skip_ws(text, 0)  # the whitespace before a list belongs to its raw text
        if j >= len(text):
            return ParsedOutput(text if final else "")  # may still become a call list
        if text[j] != "[":  # no bare list: calls only after <|python_start|>
            marker = text.find(_START)
            if marker < 0:
                return ParsedOutput(text if final else text[:len(text) - held_prefix(text, (_START,))])
            start, j = marker, skip_ws(text, marker + len(_START))
        opens = _opens_call_list(text, j)
        if opens is None and not final:
            return ParsedOutput(text[:start])  # may still become a call list
        if not opens:
            return ParsedOutput(text)
        end = _list_end(text, j)
        if end is None:
            return ParsedOutput(text[:start]).unfinished(text[start:], 0, final)
        try:
            calls = _calls(text[j:end])
        except ValueError:
            return ParsedOutput(text)
        out = ParsedOutput(text[:start], calls)
        k = skip_ws(text, end)
        if text.startswith(_END, k):
            out.content += text[k + len(_END):]
        elif not final and len(text) - k < len(_END) and _END.startswith(text[k:]):
            pass  # <|python_end|> may still come: what follows the list is held back
        else:
            out.content += text[end:]
        return out


def _opens_call_list(text: str, j: int) -> bool | None:
    """Whether text[j:] starts as "[name(" (None: the text ends before it is decided)."""
    if j >= len(text):
        return None
    if text[j] != "[":
        return False
    i = skip_ws(text, j + 1)
    if i >= len(text):
        return None
    if not (text[i].isascii() and (text[i].isalpha() or text[i] == "_")):
        return False
    while i < len(text) and text[i].isascii() and (text[i].isalnum() or text[i] == "_"):
        i += 1
    i = skip_ws(text, i)
    if i >= len(text):
        return None
    return text[i] == "("


def _list_end(text: str, j: int) -> int | None:
    """End (exclusive) of the Python list opening at text[j] (string- and bracket-aware), or None."""
    depth, i = 0, j
    while i < len(text):
        c = text[i]
        if c in "'\"":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote)
            while i < len(text) and not text.startswith(quote, i):
                i += 2 if text[i] == "\\" else 1
            if i >= len(text):
                return None
            i += len(quote)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _calls(source: str) -> list[CallSpan]:
    """The calls of a list source text; ValueError when it is not a list of calls with literal keywords."""
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise ValueError(f"not Python: {e}") from None
    if not isinstance(tree, ast.List) or not tree.elts:
        raise ValueError("not a list of calls")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("each item must be name(keyword=value, ...)")
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise ValueError("**kwargs is no argument")
            args[kw.arg] = _literal(kw.value)
        try:
            arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            raise ValueError("an argument JSON cannot carry") from None
        calls.append(CallSpan(node.func.id, arguments, True))
    return calls


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("a non-finite number")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.Name) and node.id in _NAMED_LITERALS:
        return _NAMED_LITERALS[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("dict keys must be strings")
        return dict(zip(keys, (_literal(v) for v in node.values)))
    raise ValueError(f"{ast.dump(node)[:40]} is not a literal")
