"""GrammarLimits: what a grammar may hold before it is compiled, checked in microseconds on the caller's
thread, so a grammar built to be slow is a 400 naming its field instead of seconds on the compile pool
(xgrammar cannot be interrupted: a compile that overruns its time limit keeps its thread to the end).

The limits sit far above any schema a person writes: OpenAI's structured outputs allow 5,000 object
properties, 10 levels of nesting and 1,000 enum values; here a 20,000-value enum compiles in ~0.8 s and
a 150 KB regex alternation in ~0.4 s on 2 CPU cores, while 100,000 enum values or thousands of optional
properties run for minutes. Also refused here: a $ref that is not local (#/...), which xgrammar drops
with only a log warning, leaving that part of the schema unconstrained; Shoal never fetches a URL."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from runtime.errors import InvalidRequestError

# Schema keywords whose value maps names to subschemas: the names are data (a property may be called "$ref").
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Keywords whose value is instance data, never a schema.
_DATA = frozenset({"enum", "const", "default", "examples", "example"})


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    max_json_schema_bytes: int = 256 * 1024
    max_regex_bytes: int = 64 * 1024
    max_ebnf_bytes: int = 64 * 1024
    max_enum_values: int = 10_000  # enum items plus consts, over the whole schema; also guided_choice's choices
    max_properties: int = 5_000  # object properties over the whole schema
    max_depth: int = 64  # nesting of the schema document (a level of properties is two)

    def check(self, kind: str, text: str) -> None:
        """InvalidRequestError naming `kind` (json_schema | regex | ebnf) when text is past a limit."""
        limit = {"json_schema": self.max_json_schema_bytes, "regex": self.max_regex_bytes}.get(kind,
                                                                                              self.max_ebnf_bytes)
        size = len(text.encode("utf-8", "surrogatepass")) if len(text) * 4 > limit else len(text)
        if size > limit:
            raise self._too_large(kind, f"it is {size:,} bytes, over the limit of {limit:,}")
        if kind == "json_schema":
            try:
                schema = json.loads(text)
            except (ValueError, RecursionError):
                return  # the compile says what is wrong with it
            self._check_schema(schema)

    def _check_schema(self, schema: Any) -> None:
        counts = {"enum": 0, "properties": 0}
        stack: list[tuple[Any, int, str]] = [(schema, 1, "#")]
        while stack:  # iterative: a deep document must not reach Python's recursion limit
            node, depth, where = stack.pop()
            if depth > self.max_depth:
                raise self._too_large("json_schema", f"it nests deeper than {self.max_depth} levels (at {where})")
            if isinstance(node, list):
                stack.extend((v, depth + 1, f"{where}/{i}") for i, v in enumerate(node))
                continue
            if not isinstance(node, dict):
                continue
            for key, value in node.items():
                path = f"{where}/{key}"
                if key == "$ref":
                    _check_ref(value, path)
                elif key in _DATA:
                    counts["enum"] += len(value) if key == "enum" and isinstance(value, list) else key == "const"
                elif key in _SCHEMA_MAPS and isinstance(value, dict):
                    if key == "properties":
                        counts["properties"] += len(value)
                    stack.extend((v, depth + 2, f"{path}/{name}") for name, v in value.items())
                elif isinstance(value, dict | list):
                    stack.append((value, depth + 1, path))
        if counts["enum"] > self.max_enum_values:
            raise self._too_large("json_schema", f"it lists {counts['enum']:,} enum/const values, over the limit "
                                                 f"of {self.max_enum_values:,}")
        if counts["properties"] > self.max_properties:
            raise self._too_large("json_schema", f"it declares {counts['properties']:,} object properties, over "
                                                 f"the limit of {self.max_properties:,}")

    def check_choices(self, choices: list[str], param: str) -> None:
        """guided_choice: at most max_enum_values choices (they compile as one regex alternation)."""
        if len(choices) > self.max_enum_values:
            raise InvalidRequestError(f"{param} has {len(choices):,} choices, over the limit of "
                                      f"{self.max_enum_values:,} (a limit on grammar size, so that compiling it "
                                      f"stays fast)", param=param, code="grammar_too_large")

    @staticmethod
    def _too_large(kind: str, why: str) -> InvalidRequestError:
        return InvalidRequestError(f"the {kind} grammar is too large to compile: {why}; the limits on grammar size "
                                   f"keep compiling fast for every request", param=kind, code="grammar_too_large")


def _check_ref(ref: Any, where: str) -> None:
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise InvalidRequestError(f"json_schema $ref {ref!r} at {where} is not supported: only local $ref "
                                  f"(#/...) are supported; nothing is fetched, so inline the referenced schema "
                                  f"under $defs", param="json_schema", code="invalid_grammar")
