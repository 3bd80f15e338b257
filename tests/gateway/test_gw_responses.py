"""POST /v1/responses (OpenAI's Responses API) with the official openai client, on the tiny random-weight
Llama: the greedy text and usage equal what /v1/chat/completions gives for the same conversation;
instructions reach the prompt; the stream's events come in OpenAI's order with consecutive sequence
numbers and deltas that concatenate to the non-streamed text (and the SDK's stream helper accumulates
them); max_output_tokens ends "incomplete"; text.format constrains; function tools (required / named,
and auto with reasoning through the parsers) give function_call items; what Shoal cannot honour is a 400
naming the field; unknown fields are ignored; auth and admission apply; a client leaving mid-stream
frees its KV. The stream's wire framing and logprobs: test_gw_responses_stream.py and _logprobs.py."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest
from gw_helpers import GATEWAY_ARGS, http, slow_steps, wait_kv_full
from pydantic import BaseModel, Field

from runtime import ServerArgs
from runtime.gateway import openai_responses
from runtime.gateway.output_constraint import OutputConstraint
from runtime.gateway.server import serve_in_thread

MODEL = "llama"
INPUT = [{"role": "user", "content": "Hello world!"}]
GREEDY = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": CITY}
SEARCH = {"type": "function", "name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 8}}, "required": ["query"],
    "additionalProperties": False}}
SCHEMA_OF = {t["name"]: t["parameters"] for t in (WEATHER, SEARCH)}
# What a text-only stream sends, in order: the item's opening, its deltas, its closing, the end.
_TEXT_EVENTS = re.compile(r"response\.created response\.in_progress response\.output_item\.added "
                          r"response\.content_part\.added (response\.output_text\.delta )+response\.output_text\.done "
                          r"response\.content_part\.done response\.output_item\.done response\.(completed|incomplete)")


def _chat(oai: openai.OpenAI, messages: list[dict], max_tokens: int) -> Any:
    return oai.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY)


def test_text_and_usage_equal_chat_greedy(oai):
    r = oai.responses.create(input=INPUT, max_output_tokens=12, **GREEDY)
    chat = _chat(oai, INPUT, 12)
    assert r.output_text == chat.choices[0].message.content
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [(p.type, p.annotations) for p in msg.content] == [("output_text", [])]
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (
        u.input_tokens, 12)
    assert u.total_tokens == u.input_tokens + 12 and u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens >= 0
    # A string input is one user message; instructions are a system message before it.
    as_string = oai.responses.create(input="Hello world!", max_output_tokens=12, **GREEDY)
    assert as_string.output_text == r.output_text
    system = [{"role": "system", "content": "Answer in French."}, *INPUT]
    told = oai.responses.create(input=INPUT, instructions="Answer in French.", max_output_tokens=6, **GREEDY)
    chat_told = _chat(oai, system, 6)
    assert told.output_text == chat_told.choices[0].message.content
    assert told.usage.input_tokens == chat_told.usage.prompt_tokens > u.input_tokens
    assert told.instructions == "Answer in French."


def test_input_items_render_like_chat_messages(oai):
    """developer → system, text parts, an assistant turn from an earlier output (output_text parts)."""
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be kind."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "!"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
             {"role": "user", "content": "Bye"}]
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    r = oai.responses.create(input=items, max_output_tokens=5, **GREEDY)
    chat = _chat(oai, messages, 5)
    assert (r.output_text, r.usage.input_tokens) == (chat.choices[0].message.content, chat.usage.prompt_tokens)


def _stream(oai: openai.OpenAI, **kw: Any) -> list[Any]:
    return list(oai.responses.create(stream=True, **kw))


def test_stream_events_order_and_text(oai):
    kw = dict(input=INPUT, max_output_tokens=10, **GREEDY)
    full = oai.responses.create(**kw)
    events = _stream(oai, **kw)
    assert _TEXT_EVENTS.fullmatch(" ".join(e.type for e in events)), [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, in_progress, added, part_added, *_, text_done, part_done, item_done, last = events
    assert created.response.status == in_progress.response.status == "in_progress"
    assert created.response.output == [] and created.response.id == last.response.id
    item_id = added.item.id
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(item_id, 0, 0)}
    text = "".join(e.delta for e in deltas)
    assert text == text_done.text == part_done.part.text == item_done.item.content[0].text == full.output_text
    assert added.item.content == [] and part_added.part.text == ""
    # max_output_tokens was reached: OpenAI ends such a stream with response.incomplete.
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.output_text == text and last.response.output[0].id == item_id
    assert last.response.usage.output_tokens == 10 == full.usage.output_tokens


def _stop_char(text: str) -> str | None:
    """A character of the greedy text that appears nowhere before it: as a stop string, the text ends there."""
    return next((ch for k, ch in enumerate(text) if k > 1 and ch not in text[:k] and ch.isascii()), None)


def test_completed_stream_and_the_sdk_stream_helper(oai):
    """The SDK's stream helper needs response.completed, so the output must end before max_output_tokens:
    at a stop string (vLLM's extension) taken from the greedy text of a prompt that has one."""
    for prompt in ("Hello", "Tell me a story", "What is 2+2?", "abc"):
        greedy = oai.responses.create(input=prompt, instructions="Be brief", max_output_tokens=12, **GREEDY)
        stop = _stop_char(greedy.output_text)
        if stop is not None:
            break
    assert stop is not None
    kw = dict(input=prompt, instructions="Be brief", max_output_tokens=12, model=MODEL, temperature=0,
              extra_body={"stop": [stop]})
    greedy = greedy.output_text
    full = oai.responses.create(**kw)
    assert full.status == "completed" and full.incomplete_details is None and full.completed_at >= full.created_at
    assert full.output_text == greedy[:greedy.index(stop)] and full.output[0].status == "completed"
    with oai.responses.stream(**kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == full.output_text and final.status == "completed"


def test_max_output_tokens_is_incomplete(oai):
    r = oai.responses.create(input=INPUT, max_output_tokens=3, **GREEDY)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3 and r.max_output_tokens == 3
    assert r.completed_at is None  # only a completed Response has it (the openai SDK's model says so)


class Color(BaseModel):
    color: str = Field(pattern="^(red|green|blue)$")
    count: int = Field(ge=0, le=9)


def test_text_format_json_schema_and_json_object(oai):
    schema = Color.model_json_schema()
    fmt = {"type": "json_schema", "name": "color", "schema": schema, "strict": True}
    for seed in range(3):
        r = oai.responses.create(model=MODEL, input=INPUT, text={"format": fmt}, max_output_tokens=60,
                                 temperature=1.0, extra_body={"seed": seed})
        assert r.status == "completed" and r.text.format.type == "json_schema"
        jsonschema.validate(json.loads(r.output_text), schema)
    obj = oai.responses.create(model=MODEL, input=INPUT, text={"format": {"type": "json_object"}},
                               max_output_tokens=80, temperature=0)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)
    else:  # a long object cut short is still JSON's start
        assert obj.output_text.startswith("{")
    parsed = oai.responses.parse(model=MODEL, input=INPUT, text_format=Color, max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Color)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_required_and_named_function_calls(oai, choice):
    kw = dict(model=MODEL, input=INPUT, tools=[WEATHER, SEARCH], tool_choice=choice, max_output_tokens=200,
              temperature=0)
    r = oai.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed" and not [o for o in r.output if o.type == "message"]
    for c in calls:
        assert c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed"
        assert choice == "required" or c.name == "get_weather"
        jsonschema.validate(json.loads(c.arguments), SCHEMA_OF[c.name])
    events = _stream(oai, **kw)
    streamed: dict[int, list[str]] = {}
    for e in events:
        if e.type == "response.output_item.added":
            streamed[e.output_index] = [e.item.name, ""]
        elif e.type == "response.function_call_arguments.delta":
            streamed[e.output_index][1] += e.delta
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == streamed[e.output_index][1]
    assert [tuple(v) for _, v in sorted(streamed.items())] == [(c.name, c.arguments) for c in calls]
    assert events[-1].type == "response.completed"
    # The calls and their outputs go back in as history (chat's assistant tool_calls and tool messages).
    history = [*INPUT, *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                         for c in calls],
               *[{"type": "function_call_output", "call_id": c.call_id, "output": '{"temp": 21}'} for c in calls]]
    after = oai.responses.create(model=MODEL, input=history, tools=[WEATHER, SEARCH], tool_choice="none",
                                 max_output_tokens=4, temperature=0)
    assert [o.type for o in after.output] == ["message"]
    assert after.usage.input_tokens > r.usage.input_tokens


@pytest.fixture(scope="module")
def parser_client(gw_engine):
    """The same engine behind a gateway with the hermes tool-call parser and the qwen3 reasoning parser."""
    with serve_in_thread(gw_engine, ServerArgs(tool_call_parser="hermes", reasoning_parser="qwen3"), port=0) as h:
        yield openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_reasoning_and_auto_calls_through_the_parsers(parser_client, monkeypatch):
    """A regex (in place of text.format: the Responses API has no regex field) makes the random model write
    Qwen's own format; the parsers turn it into a reasoning item, a message and a function call, streamed
    and not, alike."""
    regex = (r'<think>[a-z ]{1,12}</think>\n[A-Z][a-z]{1,8}\.\n<tool_call>\n\{"name": "search", "arguments": '
             r'\{"query": "[a-z]{1,8}"\}\}\n</tool_call>')
    monkeypatch.setattr(openai_responses, "format_constraint",
                        lambda text: OutputConstraint("regex", regex, "text.format"))
    kw = dict(model=MODEL, input=INPUT, tools=[SEARCH], max_output_tokens=120, temperature=0)
    r = parser_client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"] and r.status == "completed"
    reasoning, msg, call = r.output
    assert re.fullmatch(r"[a-z ]{1,12}", reasoning.content[0].text) and reasoning.id.startswith("rs_")
    assert re.fullmatch(r"[A-Z][a-z]{1,8}\.\n", r.output_text)
    assert call.name == "search" and re.fullmatch(r"[a-z]{1,8}", json.loads(call.arguments)["query"])
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = _stream(parser_client, **kw)
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(o.type, o.model_dump(exclude={"id", "call_id"})) for o in final.output] == [
        (o.type, o.model_dump(exclude={"id", "call_id"})) for o in r.output]
    by_type: dict[str, str] = {}
    for e in events:
        if e.type.endswith(".delta"):
            by_type[e.type] = by_type.get(e.type, "") + e.delta
    assert by_type == {"response.reasoning_text.delta": reasoning.content[0].text,
                       "response.output_text.delta": r.output_text,
                       "response.function_call_arguments.delta": call.arguments}
    dones = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"]
    assert dones == [(0, "reasoning"), (1, "message"), (2, "function_call")]  # one item open at a time


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),  # "high" is accepted (no effect)
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [WEATHER]}, "tool_choice"),  # auto needs --tool-call-parser
    ({"tools": [{**WEATHER, "name": "bad name"}], "tool_choice": "required"}, "tools[0].name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": "{oops"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": None}, "input"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER], "tool_choice": "required"},
     "text.format"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),  # alternatives of no logprobs: include asks for them
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"top_logprobs": -1, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"max_output_tokens": "many"}, "max_output_tokens"),
])
def test_what_shoal_cannot_honour_is_400_naming_the_field(gw_url, extra, param):
    status, body = http(gw_url + "/v1/responses", "POST", {"model": MODEL, "input": "hi", **extra})
    assert status == 400, body
    err = body["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_refusal_reaches_the_sdk_as_bad_request(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id" and "no state" in e.value.body["message"]


def test_accepted_fields_are_echoed_and_unknown_ones_ignored(gw_url):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "store": True, "metadata": {"k": "v"},
            "user": "u1", "safety_identifier": "s1", "prompt_cache_key": "k1", "parallel_tool_calls": False,
            "truncation": "disabled", "reasoning": {"effort": None},
            "include": ["reasoning.encrypted_content"], "service_tier": "auto", "made_up": {"x": 1},
            "stream_options": {"include_obfuscation": False}}
    status, r = http(gw_url + "/v1/responses", "POST", body)
    assert status == 200, r
    assert (r["metadata"], r["user"], r["parallel_tool_calls"], r["truncation"]) == ({"k": "v"}, "u1", False,
                                                                                      "disabled")
    assert (r["safety_identifier"], r["prompt_cache_key"], r["top_logprobs"]) == ("s1", "k1", None)
    assert r["store"] is False  # nothing is stored, whatever was asked
    assert r["tools"] == [] and r["tool_choice"] == "auto" and r["text"] == {"format": {"type": "text"}}
    # temperature and top_p as sampled with: the defaults applied (the tiny model's generation config sets
    # none), else the body's, as vLLM's; never null
    assert (r["temperature"], r["top_p"]) == (1.0, 1.0)
    status, r = http(gw_url + "/v1/responses", "POST", {**body, "temperature": 0.5, "top_p": 0.25})
    assert status == 200 and (r["temperature"], r["top_p"]) == (0.5, 0.25), r
    status, missing = http(gw_url + "/v1/responses", "POST", {"model": "other", "input": "hi"})
    assert status == 404 and missing["error"]["param"] == "model"


def test_api_key_and_admission_apply(gw_engine, monkeypatch):
    slow_steps(gw_engine, monkeypatch, 0.01)
    args = GATEWAY_ARGS.replace(api_key="sekrit", max_concurrent_requests=1)
    body = {"input": "Tell me a story", "max_output_tokens": 300, "ignore_eos": True, "stream": True}
    auth = {"Authorization": "Bearer sekrit"}
    with serve_in_thread(gw_engine, args, port=0) as server:
        url = server.url + "/v1/responses"
        status, err = http(url, "POST", {"input": "hi"})
        assert status == 401 and err["error"]["code"] == "invalid_api_key"

        async def scenario() -> None:
            async with aiohttp.ClientSession(headers=auth) as session:
                running = await session.post(url, json=body)
                assert running.status == 200
                await running.content.readline()  # streaming: it holds the one place
                async with session.post(url, json={**body, "stream": False}) as r:
                    assert r.status == 429 and r.headers["Retry-After"] == "1"
                running.close()

        asyncio.run(scenario())
    wait_kv_full(gw_engine)


def _decode_tokens(engine: Any) -> int:
    return engine.get_stats().forward_modes["DECODE"].tokens


async def test_stream_disconnect_frees_kv(gw_url, gw_engine):
    before = _decode_tokens(gw_engine)
    body = {"input": "Tell me a long story", "max_output_tokens": 450, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(gw_url + "/v1/responses", json=body)
        assert resp.status == 200
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: ")
            if seen >= 8:
                break
        resp.close()  # drop the connection mid-stream
    await asyncio.to_thread(wait_kv_full, gw_engine)
    assert _decode_tokens(gw_engine) - before < 449  # aborted, not run to the end
