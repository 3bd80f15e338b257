"""The tokenizer's worker thread and what goes to it: a gzip body counts by its decompressed size, a chat with
tools renders there (its template may write far more than the body holds), the worker's queue is bounded
(503 tokenizer_busy with Retry-After, while small requests still run on the loop), and a queued job whose
client left never runs."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from gw_helpers import http, raw

from runtime import ServerArgs
from runtime.errors import RequestAbortedError
from runtime.gateway.server import serve_in_thread

WORKER = "shoal-tokenize"
BIG = {"prompt": "ab " * 30_000, "max_tokens": 1, "truncate_prompt_tokens": 8}  # 90 KB: past the off-loop size


@pytest.fixture(scope="module")
def big_url(gw_engine) -> Iterator[str]:
    """The session's engine behind a gateway that takes 16 MB bodies (gw_server's 64 KB are never large)."""
    with serve_in_thread(gw_engine, ServerArgs(max_request_bytes=16 << 20), port=0) as handle:
        yield handle.url


@pytest.fixture()
def threads(gw_engine, monkeypatch) -> dict[str, list[tuple[str, int]]]:
    """(thread name, characters) of each encode and each chat render of the session's tokenizer."""
    tok = gw_engine.tokenizer
    seen: dict[str, list[tuple[str, int]]] = {"encode": [], "render": []}

    def spy(kind: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            seen[kind].append((threading.current_thread().name, len(args[0] if kind == "encode" else out)))
            return out
        return run

    monkeypatch.setattr(tok, "encode", spy("encode", tok.encode))
    monkeypatch.setattr(tok, "render_chat", spy("render", tok.render_chat))
    return seen


def _gzip_post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    data = gzip.compress(json.dumps(body).encode())
    return http(url, "POST", data, headers={"Content-Encoding": "gzip"})


def test_gzip_body_counts_decompressed(big_url, threads):
    status, r = _gzip_post(big_url + "/v1/completions", BIG)  # ~300 bytes on the wire
    assert status == 200 and r["usage"]["prompt_tokens"] == 8, r
    assert [name.startswith(WORKER) for name, _ in threads["encode"]] == [True]
    threads["encode"].clear()
    status, r = _gzip_post(big_url + "/v1/completions", {"prompt": "hello", "max_tokens": 1})
    assert status == 200, r
    assert threads["encode"] and not any(name.startswith(WORKER) for name, _ in threads["encode"])  # no hop


def test_chat_with_tools_renders_on_the_worker(big_url, threads):
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(5):
        schema = {"type": "object", "properties": {"a": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    status, r = http(big_url + "/v1/chat/completions", "POST", {**chat, "tools": tools, "tool_choice": "none"})
    assert status == 200, r
    status, t = http(big_url + "/tokenize", "POST", {"messages": chat["messages"], "tools": tools})
    assert status == 200 and t["count"] == r["usage"]["prompt_tokens"], t
    assert threads["render"] and all(name.startswith(WORKER) for name, _ in threads["render"])
    assert all(name.startswith(WORKER) for name, _ in threads["encode"])
    threads["render"].clear()
    threads["encode"].clear()
    assert http(big_url + "/v1/chat/completions", "POST", chat)[0] == 200  # a plain small chat: on the loop
    assert not any(name.startswith(WORKER) for name, _ in threads["render"] + threads["encode"])


def _hold(worker: Any, jobs: int) -> tuple[threading.Event, list[Any]]:
    """jobs on the worker that end once the gate opens: the first runs (waits), the rest queue behind it."""
    gate = threading.Event()
    return gate, [worker.submit(lambda: gate.wait(30)) for _ in range(jobs)]


def test_full_worker_answers_busy(big_url, gw_engine, threads):
    worker = gw_engine.tokenizer.worker
    gate, held = _hold(worker, worker.max_depth)
    try:
        status, headers, body = raw(big_url + "/v1/completions", "POST", {"Content-Type": "application/json"},
                                    json.dumps(BIG).encode())
        error = json.loads(body)["error"]
        assert status == 503 and error["code"] == "tokenizer_busy" and "busy" in error["message"], error
        assert int(headers["Retry-After"]) >= 1
        big_chat = {"messages": [{"role": "user", "content": "ab " * 30_000}], "truncate_prompt_tokens": 8}
        status, r = http(big_url + "/v1/chat/completions", "POST", big_chat)
        assert status == 503 and r["error"]["code"] == "tokenizer_busy", r
        status, r = http(big_url + "/tokenize", "POST", {"prompt": "small"})  # a small one: on the loop
        assert status == 200 and r["count"] > 0, r
    finally:
        gate.set()
    for job in held:
        job.result(timeout=10)
    assert worker.depth == 0
    assert not any(n > 1000 for _, n in threads["encode"])  # the refused bodies were never encoded


def test_gone_client_job_never_runs(big_url, gw_engine, threads):
    worker = gw_engine.tokenizer.worker
    skipped = worker.submit(lambda: pytest.fail("ran"), wanted=lambda: False)  # a gone client at its turn
    with pytest.raises(RequestAbortedError):
        skipped.result(timeout=10)
    gate, held = _hold(worker, 1)
    try:
        host, port = big_url.split("//")[1].split(":")
        data = json.dumps(BIG).encode()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
            deadline = time.monotonic() + 10
            while worker.depth < 2 and time.monotonic() < deadline:  # queued behind the held job
                time.sleep(0.02)
            assert worker.depth == 2
        deadline = time.monotonic() + 5
        while worker.depth > 1 and time.monotonic() < deadline:  # dropped from the queue once seen gone
            time.sleep(0.02)
        assert worker.depth == 1
    finally:
        gate.set()
    held[0].result(timeout=10)
    assert worker.depth == 0
    assert not any(n > 1000 for _, n in threads["encode"])  # the gone client's prompt was never encoded
