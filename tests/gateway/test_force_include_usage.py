"""--enable-force-include-usage (vLLM's should_include_usage): every streamed completion and chat
completion carries the running usage in each chunk and ends with a usage chunk of its own, whatever its
stream_options say (an explicit include_usage false too); the usage is the non-streamed request's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gw_helpers import GATEWAY_ARGS, http, sse_events

from runtime.gateway.server import serve_in_thread

CHAT = {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 5, "temperature": 0,
        "ignore_eos": True}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(gw_engine) -> Iterator[str]:
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(enable_force_include_usage=True), port=0) as handle:
        yield handle.url


def _stream(url: str, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, raw = http(url + route, "POST", {**body, "stream": True})
    assert status == 200, raw
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    return events[:-1]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("options", [None, {"include_usage": False}, {"include_usage": True}, {}])
def test_every_stream_carries_usage(url, route, options):
    body = CHAT if route == "/v1/chat/completions" else COMPLETION
    status, full = http(url + route, "POST", body)
    assert status == 200, full
    events = _stream(url, route, body | ({"stream_options": options} if options is not None else {}))
    assert all("usage" in e for e in events), events  # continuous usage in every chunk
    last = events[-1]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: the stream hits the cache
    assert last["choices"] == [] and [last["usage"][k] for k in counts] == [full["usage"][k] for k in counts]
    assert full["usage"]["completion_tokens"] == (5 if route == "/v1/chat/completions" else 4)
    running = [e["usage"]["completion_tokens"] for e in events]
    assert running == sorted(running) and {e["usage"]["prompt_tokens"] for e in events} == \
        {full["usage"]["prompt_tokens"]}
    key = "content" if route == "/v1/chat/completions" else "text"
    text = "".join((c.get("delta", c).get(key) or "") for e in events for c in e["choices"])
    assert text == (full["choices"][0]["message"]["content"] if key == "content" else full["choices"][0]["text"])


def test_without_the_flag_stream_options_decide(gw_url):
    """The session's server (flag off): no usage unless asked, as before."""
    events = _stream(gw_url, "/v1/completions", COMPLETION)
    assert not any("usage" in e for e in events)
    events = _stream(gw_url, "/v1/completions", COMPLETION | {"stream_options": {"include_usage": True}})
    assert [e for e in events if "usage" in e] == events[-1:]


def test_stream_options_without_stream_is_still_a_400(url):
    status, r = http(url + "/v1/chat/completions", "POST", CHAT | {"stream_options": {"include_usage": False}})
    assert status == 400 and r["error"]["param"] == "stream_options"


def test_responses_stream_ends_with_its_usage(url):
    """/v1/responses needs nothing of the flag: its last event's response always carries usage."""
    status, raw = http(url + "/v1/responses", "POST", {"input": "Hello", "max_output_tokens": 3, "temperature": 0,
                                                       "ignore_eos": True, "stream": True})
    assert status == 200
    last = [b for b in raw.split("\n\n") if b.startswith("event: ")][-1]
    assert last.startswith("event: response.incomplete") and '"output_tokens":3' in last.replace(" ", "")
