"""OutputConstraint: the grammar a request body asks for — OpenAI's response_format (json_object,
json_schema), SGLang/vLLM's regex and ebnf, or the schemas of tool_choice "required" / a named function —
with the body field that named it, so a grammar that fails to compile is a 400 pointing at that field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from runtime.gateway.errors import bad_request
from runtime.sampling.params import SamplingParams

# Any JSON object: what response_format json_object promises (xgrammar compiles it like a schema).
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    kind: str  # a SamplingParams grammar field: json_schema | regex | ebnf
    text: str
    param: str  # the request field it came from, for errors

    def apply(self, params: SamplingParams) -> SamplingParams:
        return msgspec.structs.replace(params, **{self.kind: self.text})

    @classmethod
    def from_body(cls, response_format: dict[str, Any] | None, regex: str | None,
                  ebnf: str | None) -> OutputConstraint | None:
        found = [c for c in (cls._response_format(response_format),
                             cls("regex", regex, "regex") if regex is not None else None,
                             cls("ebnf", ebnf, "ebnf") if ebnf is not None else None) if c is not None]
        if len(found) > 1:
            raise bad_request(f"give at most one of response_format (json), regex and ebnf; got "
                              f"{' and '.join(c.param for c in found)}", param=found[1].param)
        for c in found:
            if not c.text:
                raise bad_request(f"{c.param} must not be empty", param=c.param)
        return found[0] if found else None

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
