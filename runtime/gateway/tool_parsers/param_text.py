"""param_text: a tool-call parameter the model wrote as bare text (Qwen3-Coder's <parameter=P>VALUE</parameter>)
turned into a JSON value by the parameter's JSON schema type, as vLLM's qwen3_coder parser converts it: a
string type keeps the text as is; integer, number, boolean, object, array and null parse it; text that does
not parse as its type stays the string the model wrote (never an error: the call stands, the client sees
what the model wrote). Python literals (single quotes, None, True) parse too (ast.literal_eval: no eval);
a value JSON cannot carry (a set, bytes, a non-finite number) stays the text."""

from __future__ import annotations

import ast
import json
import math
from typing import Any

_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_CONTAINER_TYPES = ("object", "array", "arr")


def schema_type(schema: Any) -> tuple[str, bool]:
    """(the parameter's primary type, lowercased; whether null is allowed). A union (a type list or anyOf)
    takes its first non-null member; no type at all reads as string, as vLLM does."""
    if not isinstance(schema, dict):
        return "string", False
    types: list[Any]
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    elif isinstance(schema.get("anyOf"), list):
        types = [o.get("type") for o in schema["anyOf"] if isinstance(o, dict) and "type" in o]
    else:
        return "string", False
    names = [str(t).strip().lower() for t in types]
    nullable = "null" in names
    primary = next((t for t in names if t != "null"), "null" if nullable else "string")
    return primary, nullable


def is_plain_text(schema: Any) -> bool:
    """Whether convert keeps any text of this parameter as is (a string type that is not nullable, or no
    schema): its value may then stream as it is written, before it ends."""
    if schema is None:
        return True
    kind, nullable = schema_type(schema)
    return kind in _STRING_TYPES and not nullable


def convert(text: str, schema: Any) -> Any:
    """The JSON value of a parameter's text under its schema (None schema: not declared, so a string)."""
    if schema is None:
        return text
    kind, nullable = schema_type(schema)
    if nullable and text.lower() in ("null", "none"):
        return None
    if kind in _STRING_TYPES:
        return text
    if text.lower() in ("null", "none"):
        return None
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            x = float(text)
        except ValueError:
            return text
        if not math.isfinite(x):
            return text
        return int(x) if x.is_integer() else x
    if kind in ("boolean", "bool", "binary"):
        # vLLM reads anything but "true" as false; a value that is neither stays the text instead.
        return {"true": True, "false": False}.get(text.lower(), text)
    container = kind in _CONTAINER_TYPES or kind.startswith(("dict", "list"))
    value: Any = _UNPARSED
    if container:
        try:
            value = json.loads(text)
        except ValueError:
            pass
        else:
            if isinstance(value, str):  # a JSON-encoded Python repr ("{'k': 'v'}") a bad template taught
                value = _literal(value, value)
    if value is _UNPARSED:
        value = _literal(text, text)
        if container and isinstance(value, str):
            value = _literal(value, value)
    return value if _json_safe(value) else text


_UNPARSED = object()


def _literal(text: str, fallback: Any) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return fallback


def _json_safe(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True
