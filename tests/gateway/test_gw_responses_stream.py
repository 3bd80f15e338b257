"""The wire of a streamed POST /v1/responses, as OpenAI and vLLM frame it: every event is `event: <type>`
then its `data:` line, numbered by sequence_number from 0, with no `data: [DONE]`; response.created and
response.in_progress come as soon as the request is admitted, before any token exists; a failure after
the 200 headers is an error event and response.failed (the openai SDK raises it as an APIError); the
SDK's stream helper parses a text.format answer."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import aiohttp
import openai
import pytest
from gw_helpers import http, wait_kv_full
from pydantic import BaseModel, Field

from runtime.gateway import openai_responses
from runtime.gateway.errors import ApiError

MODEL = "llama"
BODY = {"model": MODEL, "input": "Hello world!", "max_output_tokens": 3, "temperature": 0, "ignore_eos": True,
        "stream": True}


def named_events(raw: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE block; asserts each is exactly an event line and a data line."""
    assert raw.endswith("\n\n") and "[DONE]" not in raw
    out = []
    for block in raw[:-2].split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return out


def test_every_event_is_named_and_numbered_without_done(gw_url):
    status, raw = http(gw_url + "/v1/responses", "POST", BODY)
    assert status == 200, raw
    events = named_events(raw)
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in names and names[-1] == "response.incomplete"
    assert events[-1][1]["response"]["usage"]["output_tokens"] == 3


async def _read_events(resp: aiohttp.ClientResponse, n: int) -> list[str]:
    """The names of the next n events of a stream (read to the blank line that ends each)."""
    names: list[str] = []
    ends = 0
    while ends < n:
        line = (await resp.content.readline()).decode()
        if line.startswith("event: "):
            names.append(line[len("event: "):].strip())
        ends += line == "\n"
    return names


def test_created_comes_before_any_token(gw_url, gw_engine, monkeypatch):
    """With the engine held before its first step, response.created and in_progress still arrive."""
    go = threading.Event()
    run_batch = gw_engine.worker.run_batch

    def held(batch: Any) -> Any:
        go.wait(timeout=30)
        return run_batch(batch)

    monkeypatch.setattr(gw_engine.worker, "run_batch", held)

    async def scenario() -> tuple[list[str], list[str]]:
        async with aiohttp.ClientSession() as session, \
                session.post(gw_url + "/v1/responses", json=BODY) as resp:
            assert resp.status == 200
            try:
                first = await asyncio.wait_for(_read_events(resp, 2), timeout=10)
            finally:
                go.set()
            rest = (await resp.read()).decode()
            return first, [name for name, _ in named_events(rest)]

    first, rest = asyncio.run(scenario())
    assert first == ["response.created", "response.in_progress"]
    assert rest[:2] == ["response.output_item.added", "response.content_part.added"]
    assert rest[-1] == "response.incomplete"


def test_a_failure_mid_stream_is_an_error_event_then_response_failed(gw_url, gw_engine, oai, monkeypatch):
    events = openai_responses._ResponsesResponder.events
    calls = []

    def failing(self: Any, c: Any, out: Any, text: str) -> list[Any]:
        calls.append(1)
        if len(calls) % 2 == 0:  # each request's second delta
            raise ApiError(500, "generation failed: boom", code="engine_error")
        return events(self, c, out, text)

    monkeypatch.setattr(openai_responses._ResponsesResponder, "events", failing)
    status, raw = http(gw_url + "/v1/responses", "POST", {**BODY, "max_output_tokens": 50})
    assert status == 200
    got = named_events(raw)
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    (name, error), (last, failed) = got[-2], got[-1]
    assert name == error["type"] == "error" and last == "response.failed"
    assert (error["code"], error["message"], error["param"]) == ("engine_error", "generation failed: boom", None)
    assert error["error"]["message"] == error["message"]
    r = failed["response"]
    assert r["status"] == "failed" and r["error"] == {"code": "server_error", "message": "generation failed: boom"}
    assert r["completed_at"] is None  # as OpenAI leaves a failed Response's
    assert r["output"][0]["status"] == "incomplete" and r["output"][0]["content"][0]["text"]
    with pytest.raises(openai.APIError, match="boom"):
        for _ in oai.responses.create(input="Hello world!", max_output_tokens=50, model=MODEL, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True}):
            pass
    wait_kv_full(gw_engine)  # both requests were aborted, not left running


class Color(BaseModel):
    color: str = Field(pattern="^(red|green|blue)$")
    count: int = Field(ge=0, le=9)


def test_sdk_stream_helper_parses_text_format(oai):
    with oai.responses.stream(model=MODEL, input="Hello world!", text_format=Color, max_output_tokens=60,
                              temperature=0) as stream:
        names = [e.type for e in stream]
        final = stream.get_final_response()
    assert names[0] == "response.created" and names[-1] == "response.completed"
    assert isinstance(final.output_parsed, Color)
    assert final.output[0].content[0].parsed == final.output_parsed
