"""X-Request-Id, as vLLM takes it: the response id is <prefix>-<id> (chatcmpl-, cmpl-, gen-; choices and
batched prompts keep their -k rids), the header comes back on every response (streams and errors too; one
made where none was sent), a bad one is a 400 naming it. A second request sending an id still in flight gets <prefix>-<id>-<8 hex>, so
/abort_request by a response id stops exactly one request; by the bare X-Request-Id it stops all that sent
it. The ids are free again once their requests end."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from typing import Any

from gw_helpers import http, slow_steps, sse_events

from runtime.gateway.app import gateway_state

MSG = [{"role": "user", "content": "Hello"}]
SHORT = {"temperature": 0, "max_tokens": 3}
NATIVE = {"temperature": 0, "max_new_tokens": 3}


def _post(url: str, body: dict[str, Any], request_id: str | None) -> tuple[int, str | None, Any]:
    """(status, the X-Request-Id header answered, body) — the header read off the raw response."""
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, echoed, raw = resp.status, resp.headers.get("X-Request-Id"), resp.read().decode()
    except urllib.error.HTTPError as e:
        status, echoed, raw = e.code, e.headers.get("X-Request-Id"), e.read().decode()
    return status, echoed, sse_events(raw) if raw.startswith("data: ") else json.loads(raw)


def test_ids_come_from_the_header_on_every_route(gw_url):
    status, echoed, r = _post(gw_url + "/v1/chat/completions", {"messages": MSG, **SHORT, "n": 2}, "trace-1")
    assert (status, echoed, r["id"]) == (200, "trace-1", "chatcmpl-trace-1") and len(r["choices"]) == 2
    status, echoed, r = _post(gw_url + "/v1/completions", {"prompt": ["a b", "c"], **SHORT}, "trace-2")
    assert (status, echoed, r["id"]) == (200, "trace-2", "cmpl-trace-2") and len(r["choices"]) == 2
    status, echoed, events = _post(gw_url + "/v1/chat/completions", {"messages": MSG, **SHORT, "stream": True},
                                   "trace-3")
    assert status == 200 and echoed == "trace-3" and events[-1] == "[DONE]"
    assert {e["id"] for e in events[:-1]} == {"chatcmpl-trace-3"}
    status, echoed, r = _post(gw_url + "/generate", {"text": "Hello", "sampling_params": NATIVE}, "trace-4")
    assert (status, echoed, r["meta_info"]["id"]) == (200, "trace-4", "gen-trace-4")
    status, _, r = _post(gw_url + "/generate", {"text": ["a", "b"], "sampling_params": NATIVE}, "trace-5")
    assert [x["meta_info"]["id"] for x in r] == ["gen-trace-5-0", "gen-trace-5-1"]
    # Without the header: random ids, and the header names the request as a sent one would (chatcmpl-<header>)
    status, echoed, r = _post(gw_url + "/v1/chat/completions", {"messages": MSG, **SHORT}, None)
    assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", echoed) and r["id"] == f"chatcmpl-{echoed}"
    status, echoed, events = _post(gw_url + "/v1/completions", {"prompt": "a", **SHORT, "stream": True}, None)
    assert status == 200 and {e["id"] for e in events[:-1]} == {f"cmpl-{echoed}"}


def test_a_header_comes_back_unsent(gw_url, oai):
    """vLLM's --enable-request-id-headers sends X-Request-Id on every response, a uuid hex where the client sent
    none: errors (before any id was made), other routes, and the body request_id where that named the response;
    so the OpenAI client's request_id is never None."""
    raw = oai.chat.completions.with_raw_response.create(model="llama", messages=MSG, **SHORT)
    assert raw.request_id is not None and raw.parse().id == f"chatcmpl-{raw.request_id}"
    status, echoed, r = _post(gw_url + "/v1/chat/completions", {"messages": MSG, "max_tokens": -1}, None)
    assert status == 400 and re.fullmatch(r"[0-9a-f]{32}", echoed), r
    status, echoed, r = _post(gw_url + "/v1/nothing-here", {}, None)
    assert status == 404 and re.fullmatch(r"[0-9a-f]{32}", echoed), r
    status, echoed, r = _post(gw_url + "/v1/responses", {"input": "Hi", "max_output_tokens": 2,
                                                         "request_id": "resp_mine"}, None)
    assert (status, echoed, r["id"]) == (200, "resp_mine", "resp_mine")
    status, echoed, r = _post(gw_url + "/v1/chat/completions", {"messages": MSG, **SHORT, "request_id": "body-1"},
                              None)
    assert (status, echoed, r["id"]) == (200, "body-1", "chatcmpl-body-1")
    with urllib.request.urlopen(gw_url + "/v1/models", timeout=10) as resp:
        assert re.fullmatch(r"[0-9a-f]{32}", resp.headers["X-Request-Id"])


def test_a_bad_header_is_a_400_naming_it(gw_url):
    for bad in ("has space", "x" * 257, "\u00e9"):
        status, echoed, r = _post(gw_url + "/v1/chat/completions", {"messages": MSG, **SHORT}, bad)
        assert status == 400 and r["error"]["param"] == "X-Request-Id", r
        # a rejected id is never echoed back (a 10 kB one would be): the response carries one made here
        assert re.fullmatch(r"[0-9a-f]{32}", echoed)


def test_duplicates_in_flight_are_told_apart_and_aborted(gw_url, gw_server, gw_engine, monkeypatch):
    state = gateway_state(gw_server.app)
    slow_steps(gw_engine, monkeypatch, 0.02)  # ~4 s each unless aborted
    body = {"messages": MSG, "temperature": 0, "max_tokens": 200, "ignore_eos": True}
    results: dict[str, Any] = {}

    def send(name: str) -> None:
        results[name] = _post(gw_url + "/v1/chat/completions", body, "dup")

    def wait_for(pred) -> None:
        deadline = time.monotonic() + 10
        while not pred():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    first = threading.Thread(target=send, args=("first",))
    first.start()
    wait_for(lambda: "chatcmpl-dup" in state.inflight)
    second = threading.Thread(target=send, args=("second",))
    second.start()
    wait_for(lambda: len([k for k in state.inflight if k.startswith("chatcmpl-dup")]) == 2)
    [other] = [k for k in state.inflight if k.startswith("chatcmpl-dup-")]
    assert re.fullmatch(r"chatcmpl-dup-[0-9a-f]{8}", other)
    # By the response id: that request alone
    status, r = http(gw_url + "/abort_request", "POST", {"rid": "chatcmpl-dup"})
    assert status == 200 and r["aborted"] == ["chatcmpl-dup-0"]
    first.join(10)
    status, echoed, r = results["first"]
    assert (status, echoed, r["id"], r["choices"][0]["finish_reason"]) == (200, "dup", "chatcmpl-dup", "abort")
    assert second.is_alive() and other in state.inflight
    # By the X-Request-Id: every request in flight that sent it (here the one left)
    status, r = http(gw_url + "/abort_request", "POST", {"rid": "dup"})
    assert status == 200 and r["aborted"] == [f"{other}-0"]
    second.join(10)
    status, echoed, r = results["second"]
    assert (status, echoed, r["id"], r["choices"][0]["finish_reason"]) == (200, "dup", other, "abort")
    assert not state.inflight and not state.ids.named  # released with their handlers
    status, _, r = _post(gw_url + "/v1/completions", {"prompt": "a", **SHORT}, "dup")
    assert r["id"] == "cmpl-dup"


def test_ids_that_could_clash_with_engine_rids_get_a_suffix(gw_server):
    """A header id stays taken RETIRED_ID_S after its handler returned (a dropped client's requests leave the
    engine at its next step: a retry in between had been refused "already in use"), and a lookalike ("x-0"
    beside "x", whose choices are x-0, x-1) gets a suffix in either order (review)."""
    state = gateway_state(gw_server.app)
    with state.request_scope("retry-1"):
        assert state.new_id("chatcmpl") == "chatcmpl-retry-1"
    with state.request_scope("retry-1"):  # the first's engine rids may still be in use
        assert re.fullmatch(r"chatcmpl-retry-1-[0-9a-f]{8}", state.new_id("chatcmpl"))
    with state.request_scope("look"):
        assert state.new_id("gen") == "gen-look"
        with state.request_scope("look-0"):
            assert re.fullmatch(r"gen-look-0-[0-9a-f]{8}", state.new_id("gen"))
    with state.request_scope("other-0"):
        assert state.new_id("gen") == "gen-other-0"
        with state.request_scope("other"):
            assert re.fullmatch(r"gen-other-[0-9a-f]{8}", state.new_id("gen"))
    with state.request_scope(""):  # an empty header is none: a random id
        assert re.fullmatch(r"gen-[0-9a-f]{32}", state.new_id("gen"))
    with state.request_scope("late"):
        pass
    assert state.new_id("gen") != "gen-late"  # outside any handler: random


def test_responses_take_the_header(gw_url):
    body = {"input": "Hello", "max_output_tokens": 2}
    status, echoed, r = _post(gw_url + "/v1/responses", body, "resp-trace-1")
    assert (status, echoed, r["id"]) == (200, "resp-trace-1", "resp_resp-trace-1")
    # Both sent: the body's id names the response, the header still comes back as sent
    status, echoed, r = _post(gw_url + "/v1/responses", {**body, "request_id": "resp_body"}, "resp-trace-2")
    assert (status, echoed, r["id"]) == (200, "resp-trace-2", "resp_body")
    status, _, r = _post(gw_url + "/v1/responses", body, "has space")
    assert status == 400 and r["error"]["param"] == "X-Request-Id"
    status, _, r = _post(gw_url + "/v1/chat/completions", {"messages": MSG, **SHORT}, "")
    assert status == 200 and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", r["id"])
