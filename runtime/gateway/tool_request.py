"""ToolRequest: a chat body's tools, tool_choice and parallel_tool_calls, checked. It says what the chat
template receives, which grammar (if any) constrains the output — "required": a JSON array of calls to
the given functions with their parameter schemas; a named function: its parameter schema — and how the
output is read back into tool calls ("auto": the model's own format, --tool-call-parser)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from runtime.gateway.errors import bad_request
from runtime.gateway.output_constraint import OutputConstraint
from runtime.gateway.tool_parsers import ToolParser, create_tool_parser
from runtime.gateway.tool_parsers.named_call import NamedCallParser
from runtime.gateway.tool_parsers.required_list import RequiredListParser

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[dict[str, Any], ...]  # OpenAI tool objects, normalized ({"type": "function", "function": {...}})
    mode: str  # none | auto | required | named
    named: str | None
    parallel: bool
    parser_name: str | None  # --tool-call-parser

    @classmethod
    def from_body(cls, tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
                  parser_name: str | None) -> ToolRequest | None:
        if not tools:
            if tool_choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", param="tool_choice")
            return None
        checked = tuple(_check_tool(k, t) for k, t in enumerate(tools))
        names = [t["function"]["name"] for t in checked]
        if len(set(names)) != len(names):
            raise bad_request("tools must have distinct function names", param="tools")
        named = None
        if tool_choice is None:
            mode = "auto"
        elif tool_choice in ("none", "auto", "required"):
            mode = tool_choice
        elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
                and isinstance(tool_choice.get("function"), dict):
            mode, named = "named", tool_choice["function"].get("name")
            if named not in names:
                raise bad_request(f"tool_choice names function {named!r}, which is not among the tools "
                                  f"({', '.join(names)})", param="tool_choice")
        else:
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                              '"function": {"name": ...}}', param="tool_choice")
        if mode == "auto" and parser_name is None:
            raise bad_request('tool_choice "auto" needs the server started with --tool-call-parser (llama3_json, '
                              'hermes, mistral, qwen3_coder or pythonic); "required" and a named function work '
                              'without it',
                              param="tool_choice")
        return cls(checked, mode, named, parallel is not False, parser_name)

    def template_tools(self) -> list[dict[str, Any]]:
        return [dict(t) for t in self.tools]

    def constraint(self) -> OutputConstraint | None:
        if self.mode == "named":
            fn = next(t["function"] for t in self.tools if t["function"]["name"] == self.named)
            return OutputConstraint("json_schema", json.dumps(fn["parameters"]), "tools")
        if self.mode != "required":
            return None
        # A tool's parameters may $ref into themselves ("#/$defs/Inner": what pydantic writes for any nested
        # model), and "#" is the array here, not the parameters: such a tool's parameters move under the
        # array's own $defs, by its tool name (unique, and the only keys there), with each local $ref
        # re-pointed there. So two tools may both define "Inner" differently (each keeps its own), with no
        # 400 — vLLM lifts the $defs themselves to the root and refuses that.
        lifted: dict[str, Any] = {}
        calls = []
        for t in self.tools:
            name, params = t["function"]["name"], t["function"]["parameters"]
            repointed = _repoint(params, f"#/$defs/{name}")
            if repointed != params:  # it has local $refs
                lifted[name] = repointed
                params = {"$ref": f"#/$defs/{name}"}
            calls.append({"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                          "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                  "minItems": 1}
        if lifted:
            schema["$defs"] = lifted
        if not self.parallel:
            schema["maxItems"] = 1
        return OutputConstraint("json_schema", json.dumps(schema), "tools")

    def parser(self) -> ToolParser | None:
        """A fresh parser for one choice's output (None: tool_choice none, output is plain content)."""
        if self.mode == "named":
            return NamedCallParser(self.named)
        if self.mode == "required":
            return RequiredListParser()
        if self.mode == "auto":
            return create_tool_parser(self.parser_name, self.tools)
        return None


def _check_tool(k: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{k}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{where}.function must be an object with a name", param=f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                          param=f"{where}.function.name")
    params = fn.get("parameters", _EMPTY_PARAMETERS)
    if not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON Schema object",
                          param=f"{where}.function.parameters")
    out = {"name": name, "parameters": params}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


# Keywords whose values are data, not schemas: a {"$ref": ...} inside them is a value to match, left alone.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names (of properties, definitions) to schemas: a name is never a keyword.
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _repoint(schema: Any, base: str) -> Any:
    """A copy of schema with every local $ref ("#", "#/...": JSON pointers from its own root) under base."""
    if isinstance(schema, list):
        return [_repoint(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = base + v[1:]
        elif k in _DATA_KEYWORDS:
            out[k] = v
        elif k in _NAMED_SCHEMAS and isinstance(v, dict):
            out[k] = {name: _repoint(sub, base) for name, sub in v.items()}
        else:
            out[k] = _repoint(v, base)
    return out
