"""The shape of OpenAI answers as clients meet it (issue 19, items 4 and 5): the role arrives with the
first token (so a client timing the first chunk measures TTFT), system_fingerprint, message.refusal,
no "usage": null in chunks, and the finish_reason of a stop-string end on its last content chunk."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from gw_helpers import http, slow_steps, sse_events, wait_kv_full

MESSAGES = [{"role": "user", "content": "Hello world!"}]
_CHAT = {"messages": MESSAGES, "temperature": 0, "ignore_eos": True}


async def _first_event_after(url: str, body: dict) -> tuple[float, dict, float]:
    """(seconds to the first SSE event, that event, seconds to the response headers)."""
    async with aiohttp.ClientSession() as session:
        t0 = time.monotonic()
        async with session.post(url, json=body) as resp:
            headers_at = time.monotonic() - t0
            async for line in resp.content:
                if line.startswith(b"data: "):
                    return time.monotonic() - t0, json.loads(line[6:]), headers_at
    raise AssertionError("no event")


def test_chat_role_comes_with_the_first_token(gw_url, gw_engine, monkeypatch):
    slow_steps(gw_engine, monkeypatch, 0.5)  # prefill takes >= 0.5 s
    first_at, event, headers_at = asyncio.run(_first_event_after(
        gw_url + "/v1/chat/completions", {**_CHAT, "max_tokens": 2, "stream": True, "logprobs": True}))
    [choice] = event["choices"]
    assert choice["delta"]["role"] == "assistant"
    assert len(choice["logprobs"]["content"]) >= 1  # the first token is in the same chunk as the role
    assert first_at >= 0.5 > headers_at  # the 200 went out at once; the first chunk waited for prefill
    wait_kv_full(gw_engine)


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0}),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": 3}),
])
def test_fingerprint_refusal_and_no_null_usage(gw_url, route, body):
    status, full = http(gw_url + route, "POST", body)
    assert status == 200 and full["system_fingerprint"].startswith("fp_")
    if route == "/v1/chat/completions":
        message = full["choices"][0]["message"]
        assert "refusal" in message and message["refusal"] is None
    for options in (None, {"include_usage": True}):
        stream = {**body, "stream": True} | ({"stream_options": options} if options else {})
        _, raw = http(gw_url + route, "POST", stream)
        events = [e for e in sse_events(raw) if e != "[DONE]"]
        assert {e["system_fingerprint"] for e in events} == {full["system_fingerprint"]}
        with_usage = [e for e in events if "usage" in e]
        if options:  # only the last chunk, of its own, has usage
            assert with_usage == events[-1:] and events[-1]["choices"] == []
            assert events[-1]["usage"]["completion_tokens"] == 3
        else:
            assert with_usage == []


def _stream_chat(url: str, body: dict) -> list[dict]:
    status, raw = http(url + "/v1/chat/completions", "POST", {**body, "stream": True})
    assert status == 200, raw
    return [e for e in sse_events(raw) if e != "[DONE]"]


def _stop_inside_a_token(pieces: list[str]) -> str | None:
    """A one-character stop string that ends a token's text past its first character and appears nowhere
    before: the text before it in that token is the last content, and the engine stops on that token."""
    return next((p[-1] for k, p in enumerate(pieces)
                 if k and len(p) >= 2 and p[-1] not in "".join(pieces[:k]) + p[:-1]), None)


def _token_texts(url: str, body: dict) -> list[str]:
    """Each output token's text (chat logprobs): stream chunks are no substitute, since a consumer slower
    than the engine gets several tokens' deltas merged into one chunk (the test failed that way under
    load: its "stop inside a token" was a whole token of its own)."""
    status, raw = http(url + "/v1/chat/completions", "POST", {**body, "logprobs": True})
    assert status == 200, raw
    return [c["token"] for c in raw["choices"][0]["logprobs"]["content"]]


def test_stop_string_finish_is_on_the_last_content_chunk(gw_url):
    for prompt in ("Tell me a story about a cat", "Hello world!", "Why is the sky blue?"):
        body = {**_CHAT, "messages": [{"role": "user", "content": prompt}], "max_tokens": 20}
        pieces = _token_texts(gw_url, body)
        stop = _stop_inside_a_token(pieces)
        if stop is not None:
            break
    assert stop is not None, pieces
    text = "".join(pieces)
    events = _stream_chat(gw_url, {**body, "stop": [stop]})
    with_content = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    last = with_content[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["matched_stop"] == stop
    assert events[-1] is with_content[-1]  # no empty finish chunk after it
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == text[:text.index(stop)]
    # Other ends keep OpenAI's separate finish chunk with an empty delta.
    plain = _stream_chat(gw_url, {**body, "max_tokens": 3})
    assert plain[-1]["choices"][0]["delta"] == {} and plain[-1]["choices"][0]["finish_reason"] == "length"


def _special_token(engine) -> tuple[int, str]:
    """A token whose text only shows with skip_special_tokens false."""
    tok = engine.tokenizer
    return next((t, tok.decode([t], skip_special_tokens=False)) for t in range(64)
                if tok.decode([t], skip_special_tokens=False) and not tok.decode([t]))


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_of_special_token_text_ends_the_request_in_the_engine(gw_url, gw_engine, stream):
    """With skip_special_tokens false the scheduler's stop check sees special tokens as the detokenizer
    does: the engine itself ends the request on the first such token (finish stop, the string matched),
    not the gateway aborting it later."""
    token, text = _special_token(gw_engine)
    body = {"prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stop": [text],
            "skip_special_tokens": False, "logit_bias": {str(token): 100}, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, got = http(gw_url + "/v1/completions", "POST", body)
    assert status == 200, got
    if stream:
        events = [e for e in sse_events(got) if e != "[DONE]"]
        choices = [e["choices"][0] for e in events if e["choices"]]
        assert [c["finish_reason"] for c in choices] == ["stop"] and choices[0]["text"] == ""
        assert choices[-1]["matched_stop"] == text
        usage = events[-1]["usage"]
    else:
        choice = got["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"] == "" and choice["matched_stop"] == text
        usage = got["usage"]
    assert usage["completion_tokens"] == 1  # the engine stopped on the very token
    wait_kv_full(gw_engine)
    status, native = http(gw_url + "/generate", "POST", {"text": "Hello", "sampling_params": {
        "max_new_tokens": 200, "ignore_eos": True, "stop": [text], "skip_special_tokens": False,
        "logit_bias": {str(token): 100}}})
    meta = native["meta_info"]
    assert meta["finish_reason"]["type"] == "stop" and meta["finish_reason"]["matched"] == text, meta
    assert meta["completion_tokens"] == 1
    # skip_special_tokens true (the default): that text never appears, so the request runs to its end.
    body = {**body, "stream": False, "max_tokens": 5, "skip_special_tokens": True}
    body.pop("stream_options", None)
    status, plain = http(gw_url + "/v1/completions", "POST", body)
    assert plain["choices"][0]["finish_reason"] == "length" and plain["usage"]["completion_tokens"] == 5
