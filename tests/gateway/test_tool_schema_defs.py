"""tool_choice "required" with tools whose parameters $ref their own $defs (what openai.pydantic_function_tool
writes for any nested model): each such tool's parameters move under the array schema's $defs by tool name,
their local $refs re-pointed there, so two tools may define the same $defs name differently and each call is
held to its own. Over HTTP with the openai client, every call's arguments validate against its tool's model;
a tool without parameters gives "{}" once written, and stream and body agree where max_tokens cut it first."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from gw_helpers import http, sse_events
from pydantic import BaseModel, Field

from runtime.gateway.tool_request import ToolRequest

pytest.importorskip("xgrammar")

MSG = [{"role": "user", "content": "Hello"}]


class Inner(BaseModel):  # named alike in both tools, defined differently
    flag: bool


class Light(BaseModel):
    where: Inner
    level: int = Field(ge=0, le=9)


class Inner2(BaseModel):
    word: Literal["yes", "no"]


class Note(BaseModel):
    inner: Inner2
    tags: list[Literal["x", "y"]] = Field(max_length=2)


class Tree(BaseModel):
    label: Literal["a", "b"]
    kids: list[Tree]  # recursive: "#/$defs/Tree" from its own root


def _tools() -> list[dict]:
    light = openai.pydantic_function_tool(Light, name="light")
    note = openai.pydantic_function_tool(Note, name="note")
    params = note["function"]["parameters"]  # rename Inner2 to Inner: one $defs name, two schemas
    params["$defs"]["Inner"] = params["$defs"].pop("Inner2")
    params["properties"]["inner"] = {"$ref": "#/$defs/Inner"}
    assert light["function"]["parameters"]["$defs"]["Inner"] != params["$defs"]["Inner"]
    return [light, note]


MODELS = {"light": Light, "note": Note}
PLAIN = {"type": "function", "function": {"name": "plain", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["n"]}}}


def test_constraint_holds_each_call_to_its_own_defs():
    tools = _tools() + [PLAIN, openai.pydantic_function_tool(Tree, name="tree")]
    req = ToolRequest.from_body(tools, "required", None, None)
    schema = json.loads(req.constraint().text)
    assert set(schema["$defs"]) == {"light", "note", "tree"}  # PLAIN has no $ref: left inline as before
    plain = next(c for c in schema["items"]["anyOf"] if c["properties"]["name"]["const"] == "plain")
    assert plain["properties"]["parameters"] == PLAIN["function"]["parameters"]
    validator = jsonschema.Draft202012Validator(schema)
    light = {"where": {"flag": True}, "level": 3}
    note = {"inner": {"word": "yes"}, "tags": ["x"]}
    tree = {"label": "a", "kids": [{"label": "b", "kids": []}]}
    assert validator.is_valid([{"name": "light", "parameters": light}, {"name": "note", "parameters": note},
                               {"name": "plain", "parameters": {"n": 1}}, {"name": "tree", "parameters": tree}])
    # Each call against its own Inner, not the other tool's; the recursion reaches the tree's own root
    assert not validator.is_valid([{"name": "light", "parameters": {**light, "where": {"word": "yes"}}}])
    assert not validator.is_valid([{"name": "note", "parameters": {**note, "inner": {"flag": True}}}])
    assert not validator.is_valid([{"name": "tree", "parameters": {"label": "a", "kids": [{"label": "c", "kids": []}]}}])
    # The request's own tools are untouched (the chat template shows them as sent)
    assert tools[0]["function"]["parameters"]["properties"]["where"] == {"$ref": "#/$defs/Inner"}
    assert req.template_tools()[0]["function"]["parameters"] == tools[0]["function"]["parameters"]


def test_repointing_leaves_data_and_property_names_alone():
    params = {"type": "object", "$defs": {"D": {"type": "integer"}},
              "properties": {"default": {"$ref": "#/$defs/D"}, "self": {"$ref": "#"},
                             "c": {"const": {"$ref": "#/$defs/D"}}}}
    req = ToolRequest.from_body([{"type": "function", "function": {"name": "t", "parameters": params}}],
                                "required", False, None)
    schema = json.loads(req.constraint().text)
    lifted = schema["$defs"]["t"]["properties"]
    assert lifted["default"] == {"$ref": "#/$defs/t/$defs/D"}  # a property named like a keyword: a schema
    assert lifted["self"] == {"$ref": "#/$defs/t"}  # "#" was the parameters themselves
    assert lifted["c"] == {"const": {"$ref": "#/$defs/D"}}  # data, matched as given
    assert schema["items"]["properties"]["parameters"] == {"$ref": "#/$defs/t"} and schema["maxItems"] == 1


def test_required_calls_validate_over_http(gw_url, oai):
    tools = _tools()
    seen = set()
    for seed in range(4):
        r = oai.chat.completions.create(model="llama", messages=MSG, tools=tools, tool_choice="required",
                                        max_tokens=160, temperature=1.0, seed=seed, parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        for call in choice.message.tool_calls:
            MODELS[call.function.name].model_validate_json(call.function.arguments)  # its own Inner
            seen.add(call.function.name)
    assert seen == {"light", "note"}, seen
    # The named form took the parameters as they are already (their $defs at the root)
    r = oai.chat.completions.create(model="llama", messages=MSG, tools=tools, max_tokens=160,
                                    tool_choice={"type": "function", "function": {"name": "note"}})
    Note.model_validate_json(r.choices[0].message.tool_calls[0].function.arguments)


def test_tool_without_parameters(gw_url):
    """"{}" once the model wrote it (tool_calls); cut off before that, the arguments are what was written, ""
    in the body as in the stream — vLLM's stream gives the same, and "{}" would claim a call never finished."""
    body = {"messages": MSG, "temperature": 0, "tools": [{"type": "function", "function": {"name": "noargs"}}],
            "tool_choice": "required"}
    status, r = http(gw_url + "/v1/chat/completions", "POST", {**body, "max_tokens": 200})
    assert status == 200, r
    [call] = r["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "noargs", "arguments": "{}"} and r["choices"][0]["finish_reason"] == "tool_calls"
    completion = r["usage"]["completion_tokens"]
    for cut in range(completion - 8, completion):
        status, r = http(gw_url + "/v1/chat/completions", "POST", {**body, "max_tokens": cut})
        calls = r["choices"][0]["message"]["tool_calls"] or []
        _, raw = http(gw_url + "/v1/chat/completions", "POST", {**body, "max_tokens": cut, "stream": True})
        streamed: dict[int, str] = {}
        deltas = [e["choices"][0]["delta"] for e in sse_events(raw) if e != "[DONE]" and e["choices"]]
        for tc in (tc for d in deltas for tc in d.get("tool_calls") or []):
            streamed[tc["index"]] = streamed.get(tc["index"], "") + tc["function"].get("arguments", "")
        assert [c["function"]["arguments"] for c in calls] == [streamed[i] for i in sorted(streamed)]
        assert all("{}".startswith(c["function"]["arguments"].strip()) for c in calls)
