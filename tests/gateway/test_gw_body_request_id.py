"""vLLM's body field `request_id` names the response as X-Request-Id does, the header going first: chat
(chatcmpl-<id>, streams too), completions (cmpl-<id>), /v1/responses (the id verbatim, before the header: vLLM
answers with it as sent), /v1/embeddings (embd-<id>), /pooling (pool-<id>), /classify (classify-<id>). The same
clash rules (a suffix, never a 400), /abort_request by it, and a 400 naming request_id for an empty, spaced or
non-string one (even beside a good header). It is no longer counted as an ignored field."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gw_helpers import http, slow_steps, sse_events

from runtime import Engine
from runtime.gateway.app import gateway_state

sys.path.insert(0, str(Path(__file__).parents[1] / "classify"))
from classify_models import ENGINE_KWARGS, call, classifier_copy, post  # noqa: E402

MSG = [{"role": "user", "content": "Hello"}]
SHORT = {"temperature": 0, "max_tokens": 2}


def _post(url: str, body: dict[str, Any], header: str | None = None) -> tuple[int, Any]:
    status, r = http(url, "POST", body, headers={"X-Request-Id": header} if header is not None else None)
    if isinstance(r, str):  # a stream (Responses' blocks open with an `event:` line)
        r = sse_events("\n\n".join(line for line in r.splitlines() if line.startswith("data: ")) + "\n\n")
    return status, r


def test_body_request_id_names_each_generation_route(gw_url, gw_server):
    status, r = _post(gw_url + "/v1/chat/completions", {"messages": MSG, **SHORT, "n": 2, "request_id": "b-1"})
    assert (status, r["id"], len(r["choices"])) == (200, "chatcmpl-b-1", 2)
    status, r = _post(gw_url + "/v1/completions", {"prompt": ["a b", "c"], **SHORT, "request_id": "b-2"})
    assert (status, r["id"], len(r["choices"])) == (200, "cmpl-b-2", 2)
    status, events = _post(gw_url + "/v1/chat/completions",
                           {"messages": MSG, **SHORT, "stream": True, "request_id": "b-3"})
    assert status == 200 and events[-1] == "[DONE]" and {e["id"] for e in events[:-1]} == {"chatcmpl-b-3"}
    body = {"input": "Hello", "max_output_tokens": 2}
    status, r = _post(gw_url + "/v1/responses", {**body, "request_id": "b-4"})  # vLLM's: verbatim, no resp_
    assert (status, r["id"]) == (200, "b-4")
    status, r = _post(gw_url + "/v1/responses", {**body, "request_id": "resp_b-5"})
    assert (status, r["id"]) == (200, "resp_b-5")
    status, events = _post(gw_url + "/v1/responses", {**body, "stream": True, "request_id": "b-6"})
    assert status == 200 and {e["response"]["id"] for e in events if "response" in e} == {"b-6"}
    # vLLM's Responses API reads no header for the id: the body's goes first there (the header alone names it
    # resp_<header>: test_gw_request_id.py)
    status, r = _post(gw_url + "/v1/responses", {**body, "request_id": "b-8"}, "h-8")
    assert (status, r["id"]) == (200, "b-8")
    # The header goes first; null is none sent
    status, r = _post(gw_url + "/v1/chat/completions", {"messages": MSG, **SHORT, "request_id": "b-7"}, "h-7")
    assert (status, r["id"]) == (200, "chatcmpl-h-7")
    status, r = _post(gw_url + "/v1/completions", {"prompt": "a", **SHORT, "request_id": None})
    assert status == 200 and re.fullmatch(r"cmpl-[0-9a-f]{32}", r["id"])
    assert "request_id" not in gateway_state(gw_server.app).ignored_fields.seen
    assert not gateway_state(gw_server.app).ids.named  # released with their handlers


@pytest.mark.parametrize("bad", ["", "has space", "x" * 257, 5, ["a"]])
def test_a_bad_body_request_id_is_a_400_naming_it(gw_url, bad):
    for path, body in (("/v1/chat/completions", {"messages": MSG, **SHORT}), ("/v1/responses", {"input": "Hi"})):
        status, r = _post(gw_url + path, {**body, "request_id": bad})
        assert status == 400 and r["error"]["param"] == "request_id", r
    status, r = _post(gw_url + "/v1/completions", {"prompt": "a", **SHORT, "request_id": bad}, "good-header")
    assert status == 400 and r["error"]["param"] == "request_id", r


def test_body_ids_follow_the_header_clash_rules(gw_server):
    state = gateway_state(gw_server.app)
    with state.request_scope(None):
        assert state.new_id("chatcmpl", request_id="again") == "chatcmpl-again"
    with state.request_scope(None):  # the first's engine rids may still be in use
        assert re.fullmatch(r"chatcmpl-again-[0-9a-f]{8}", state.new_id("chatcmpl", request_id="again"))
    with state.request_scope("like"):  # a header "like" in flight; a body id "like-0" looks like its choice
        assert state.new_id("gen") == "gen-like"
        with state.request_scope(None):
            assert re.fullmatch(r"gen-like-0-[0-9a-f]{8}", state.new_id("gen", request_id="like-0"))
    with state.request_scope("hdr"):
        assert state.new_id("resp", "_", "kept", as_sent=True) == "kept"
        assert re.fullmatch(r"kept-[0-9a-f]{8}", state.new_id("resp", "_", "kept", as_sent=True))
        assert state.new_id("resp", "_", None, as_sent=True) == "resp_hdr"
    assert state.new_id("gen", request_id="outside") != "gen-outside"  # outside any handler: random


def test_abort_by_the_body_request_id(gw_url, gw_server, gw_engine, monkeypatch):
    state = gateway_state(gw_server.app)
    slow_steps(gw_engine, monkeypatch, 0.02)  # ~4 s unless aborted
    result: dict[str, Any] = {}
    body = {"messages": MSG, "temperature": 0, "max_tokens": 200, "ignore_eos": True, "request_id": "stop-me"}
    sender = threading.Thread(target=lambda: result.update(r=_post(gw_url + "/v1/chat/completions", body)))
    sender.start()
    deadline = time.monotonic() + 10
    while "chatcmpl-stop-me" not in state.inflight:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    status, r = http(gw_url + "/abort_request", "POST", {"rid": "stop-me"})
    assert status == 200 and r["aborted"] == ["chatcmpl-stop-me-0"]
    sender.join(10)
    status, r = result["r"]
    assert (status, r["id"], r["choices"][0]["finish_reason"]) == (200, "chatcmpl-stop-me", "abort")
    # /v1/responses sent both: the body's id named it, so that finds it; the header names nothing there
    body = {"input": "Hello", "temperature": 0, "max_output_tokens": 200, "ignore_eos": True, "request_id": "resp-me"}
    sender = threading.Thread(target=lambda: result.update(r=_post(gw_url + "/v1/responses", body, "hdr-me")))
    sender.start()
    while "resp-me" not in state.inflight:
        assert time.monotonic() < deadline + 10
        time.sleep(0.01)
    assert http(gw_url + "/abort_request", "POST", {"rid": "hdr-me"})[1]["aborted"] == ["hdr-me"]  # none such
    assert sender.is_alive() and "resp-me" in state.inflight
    status, r = http(gw_url + "/abort_request", "POST", {"rid": "resp-me"})
    assert status == 200 and r["aborted"] == ["resp-me-0"]
    sender.join(10)
    status, r = result["r"]
    assert status == 200 and r["id"] == "resp-me" and r["usage"]["output_tokens"] < 200, r


@pytest.fixture(scope="module")
def classifier(tiny_model_dirs, tmp_path_factory):
    """The tiny Qwen3 with a 3-label score head, as an --is-embedding server: every pooling route."""
    path = classifier_copy(tiny_model_dirs["qwen3"], tmp_path_factory.mktemp("rid") / "qwen3", ["a", "b", "c"])
    engine = Engine(str(path), is_embedding=True, **ENGINE_KWARGS)
    yield engine
    engine.shutdown()


def test_body_request_id_names_each_pooling_route(classifier):
    async def scenario(client: Any) -> None:
        for path, prefix in (("/v1/embeddings", "embd"), ("/pooling", "pool"), ("/classify", "classify")):
            status, out = await post(client, path, {"input": ["Hello", "a b"], "request_id": f"{prefix}-x"})
            assert (status, out["id"], len(out["data"])) == (200, f"{prefix}-{prefix}-x", 2), out
            status, out = await post(client, path, {"input": "Hello", "request_id": ""})
            assert status == 400 and out["error"]["param"] == "request_id", out
        r = await client.post("/v1/embeddings", json={"input": "Hello", "request_id": "body"},
                              headers={"X-Request-Id": "hdr"})
        assert (await r.json())["id"] == "embd-hdr"
        # SGLang's /classify form names its request by rid: request_id there is a 400, not passed over
        status, out = await post(client, "/classify", {"text": "Hello", "request_id": "x"})
        assert status == 400 and out["error"]["param"] == "request_id", out

    call(classifier, scenario)
