"""OutputConstraint: the grammar a request body asks for — OpenAI's response_format (json_object,
json_schema), SGLang/vLLM's regex and ebnf, SGLang's json_schema (JSON text), vLLM's guided_json /
guided_regex / guided_choice / guided_grammar and its newer structured_outputs object, or the schemas of
tool_choice "required" / a named function — with the body field that named it, so a grammar that fails to compile is a 400
pointing at that field. A body may ask for one at most: two are a 400 naming both."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from runtime.errors import InvalidRequestError
from runtime.gateway.errors import bad_request, not_supported
from runtime.gateway.protocol import OpenAISamplingFields, StructuredOutputs
from runtime.sampling.grammar_limits import GrammarLimits
from runtime.sampling.params import SamplingParams

# Any JSON object: what response_format json_object promises (xgrammar compiles it like a schema).
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# What a regex reads as syntax; xgrammar warns on (and some engines refuse) escapes of anything else,
# so re.escape (which escapes spaces, '#', '&', '~') is not used.
_REGEX_SYNTAX = frozenset("\\.^$|?*+()[]{}/-")
_CONTROL = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\f": "\\f", "\v": "\\v"}


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of choices, each taken literally."""
    return "(" + "|".join("".join("\\" + c if c in _REGEX_SYNTAX else _CONTROL.get(c, c) for c in s)
                              for s in choices) + ")"


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    kind: str  # a SamplingParams grammar field: json_schema | regex | ebnf
    text: str
    param: str  # the request field it came from, for errors

    def apply(self, params: SamplingParams) -> SamplingParams:
        return msgspec.structs.replace(params, **{self.kind: self.text})

    @classmethod
    def from_body(cls, body: OpenAISamplingFields) -> OutputConstraint | None:
        found = [c for c in (cls._response_format(body.response_format),
                             cls._string("regex", body.regex, "regex"),
                             cls._string("ebnf", body.ebnf, "ebnf"),
                             cls._schema(body.json_schema, "json_schema"),
                             cls._schema(body.guided_json, "guided_json"),
                             cls._string("regex", body.guided_regex, "guided_regex"),
                             cls._choice(body.guided_choice, "guided_choice"),
                             cls._string("ebnf", body.guided_grammar, "guided_grammar"),
                             *cls._structured_outputs(body.structured_outputs)) if c is not None]
        if len(found) > 1:
            raise bad_request(f"give at most one structured-output constraint (response_format, regex, ebnf, "
                              f"json_schema, guided_json, guided_regex, guided_choice, guided_grammar, "
                              f"structured_outputs); "
                              f"got {' and '.join(c.param for c in found)}", param=found[1].param)
        for c in found:
            if not c.text:
                raise bad_request(f"{c.param} must not be empty", param=c.param)
        return found[0] if found else None

    @classmethod
    def _string(cls, kind: str, text: str | None, param: str) -> OutputConstraint | None:
        return cls(kind, text, param) if text is not None else None

    @classmethod
    def _schema(cls, schema: dict[str, Any] | str | None, param: str) -> OutputConstraint | None:
        """vLLM's guided_json, SGLang's json_schema: a JSON Schema as an object or as JSON text."""
        if schema is None:
            return None
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise bad_request(f"{param} is a string but not JSON text: {e}", param=param) from None
            if not isinstance(schema, dict):
                raise bad_request(f"{param} must be a JSON Schema object, got JSON {type(schema).__name__}",
                                  param=param)
        return cls("json_schema", json.dumps(schema), param)

    @classmethod
    def _choice(cls, choices: list[str] | None, param: str) -> OutputConstraint | None:
        if choices is None:
            return None
        if not choices:
            raise bad_request(f"{param} must hold at least one choice", param=param)
        try:
            GrammarLimits().check_choices(choices, param)
        except InvalidRequestError as e:
            raise bad_request(e.message, param=param, code=e.code) from None
        return cls("regex", choice_regex(choices), param)

    @classmethod
    def _structured_outputs(cls, so: StructuredOutputs | None) -> list[OutputConstraint | None]:
        if so is None:
            return []
        if so.structural_tag is not None:
            raise not_supported("structured_outputs.structural_tag", "structured_outputs.structural_tag")
        return [cls._schema(so.json, "structured_outputs.json"),
                cls._string("regex", so.regex, "structured_outputs.regex"),
                cls._choice(so.choice, "structured_outputs.choice"),
                cls._string("ebnf", so.grammar, "structured_outputs.grammar"),
                cls("json_schema", JSON_OBJECT_SCHEMA, "structured_outputs.json_object") if so.json_object else None]

    @classmethod
    def _response_format(cls, rf: dict[str, Any] | None) -> OutputConstraint | None:
        if rf is None:
            return None
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_schema", JSON_OBJECT_SCHEMA, "response_format")
        if kind != "json_schema":
            raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                              param="response_format.type")
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format json_schema needs a json_schema object with a schema",
                              param="response_format.json_schema")
        schema = spec.get("schema", {"type": "object"})  # OpenAI: schema is optional
        if not isinstance(schema, dict):
            raise bad_request(f"response_format.json_schema.schema must be a JSON Schema object, got "
                              f"{type(schema).__name__}", param="response_format.json_schema.schema")
        return cls("json_schema", json.dumps(schema), "response_format.json_schema.schema")
