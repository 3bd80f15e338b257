"""The tokenizer's worker and what goes to its lanes: a gzip body counts by its decompressed size (the large
lane), a small chat with tools renders on the small lane (its template may write far more than the body holds)
and never waits behind a large body, the large lane takes many mid-size prompts and refuses only past a
minute of queued work (503 tokenizer_busy with Retry-After), and a queued job whose client left never runs.
A job is sized by the characters it works on (a padded body with a short prompt is encoded on the loop), its
rate is learned from every job (failed ones too) within a clamp, so no sender can teach the lanes to admit
hours of work or to refuse a burst of prompts, and backstops bound the large lane whatever it learned."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from gw_helpers import http, raw

from runtime import ServerArgs
from runtime.errors import RequestAbortedError
from runtime.gateway.server import serve_in_thread
from runtime.text import tokenizer_worker
from runtime.text.tokenizer_worker import FIRST_RATE, RATE_SPAN, TokenizerBusyError, TokenizerWorker

WORKER, SMALL, LARGE = "shoal-tokenize", "shoal-tokenize-small", "shoal-tokenize-large"
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
    assert [name.startswith(LARGE) for name, _ in threads["encode"]] == [True]
    threads["encode"].clear()
    status, r = _gzip_post(big_url + "/v1/completions", {"prompt": "hello", "max_tokens": 1})
    assert status == 200, r
    assert threads["encode"] and not any(name.startswith(WORKER) for name, _ in threads["encode"])  # no hop
    threads["encode"].clear()
    padded = json.dumps({"prompt": "hi", "max_tokens": 1}) + " " * 100_000  # a large body, a short prompt
    status, r = http(big_url + "/v1/completions", "POST", padded.encode())
    assert status == 200, r
    assert threads["encode"] and not any(name.startswith(WORKER) for name, _ in threads["encode"])
    threads["encode"].clear()
    chat = {"messages": [{"role": "user", "content": BIG["prompt"]}], "max_tokens": 1, "truncate_prompt_tokens": 8}
    status, r = _gzip_post(big_url + "/v1/chat/completions", chat)
    assert status == 200, r  # rendered, then encoded as a job of its own sized by the text
    assert [name.startswith(LARGE) for name, _ in threads["render"] + threads["encode"]] == [True, True]


def _hold(worker: Any, jobs: int, size: int = 0, small: bool = False) -> tuple[threading.Event, list[Any]]:
    """jobs on a lane that end once the gate opens: the first runs (waits), the rest queue behind it."""
    gate = threading.Event()
    return gate, [worker.submit(lambda: gate.wait(30), size, small=small) for _ in range(jobs)]


def _in_threads(calls: list[Callable[[], Any]]) -> list[Any]:
    """Each call's result, all of them running at once."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_small_tools_chat_never_waits_behind_a_large_body(big_url, gw_engine, threads):
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(5):
        schema = {"type": "object", "properties": {"a": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    gate, held = _hold(gw_engine.tokenizer.worker, 1)  # stands for a large body being encoded (3 MB: ~9 s)
    try:
        start = time.monotonic()
        status, r = http(big_url + "/v1/chat/completions", "POST", {**chat, "tools": tools, "tool_choice": "none"})
        assert status == 200, r
        status, t = http(big_url + "/tokenize", "POST", {"messages": chat["messages"], "tools": tools})
        assert status == 200 and t["count"] == r["usage"]["prompt_tokens"], t
        assert time.monotonic() - start < 5 and not gate.is_set()  # served while the large lane is held
    finally:
        gate.set()
    held[0].result(timeout=10)
    assert threads["render"] and all(name.startswith(SMALL) for name, _ in threads["render"])
    assert all(name.startswith(SMALL) for name, _ in threads["encode"])
    threads["render"].clear()
    threads["encode"].clear()
    assert http(big_url + "/v1/chat/completions", "POST", chat)[0] == 200  # a plain small chat: on the loop
    assert not any(name.startswith(WORKER) for name, _ in threads["render"] + threads["encode"])


def test_many_mid_size_prompts_pass(big_url, gw_engine, threads):
    worker = gw_engine.tokenizer.worker
    body = {"prompt": "ab " * 23_400, "max_tokens": 1, "truncate_prompt_tokens": 8}  # 70 KB
    gate, held = _hold(worker, 1)
    try:
        calls = [lambda: http(big_url + "/v1/completions", "POST", body) for _ in range(16)]
        with ThreadPoolExecutor(1) as pool:
            answers = pool.submit(_in_threads, calls)
            deadline = time.monotonic() + 10
            while worker.depth < 17 and time.monotonic() < deadline:  # all queued behind the held job
                time.sleep(0.02)
            assert worker.depth == 17 and worker.large.bytes >= 16 * 70_000
            gate.set()
            results = answers.result(timeout=60)
    finally:
        gate.set()
    held[0].result(timeout=10)
    assert [status for status, _ in results] == [200] * 16, results[0]
    assert all(r["usage"]["prompt_tokens"] == 8 for _, r in results)
    assert worker.depth == 0 and worker.large.bytes == 0


def test_queued_work_bound_answers_busy(big_url, gw_engine, threads, monkeypatch):
    worker = TokenizerWorker(first_rate=1000.0)  # 1 KB/s: a 70 KB job in line is 70 s of work
    monkeypatch.setattr(gw_engine.tokenizer, "worker", worker)
    gate, held = _hold(worker, 1, 70_000)
    try:
        status, headers, body = raw(big_url + "/v1/completions", "POST", {"Content-Type": "application/json"},
                                    json.dumps(BIG).encode())
        error = json.loads(body)["error"]
        assert status == 503 and error["code"] == "tokenizer_busy" and "busy" in error["message"], error
        assert headers["Retry-After"] == "70"  # the queued seconds
        big_chat = {"messages": [{"role": "user", "content": "ab " * 30_000}], "truncate_prompt_tokens": 8}
        status, r = http(big_url + "/v1/chat/completions", "POST", big_chat)
        assert status == 503 and r["error"]["code"] == "tokenizer_busy", r
        status, r = http(big_url + "/tokenize", "POST", {"prompt": "small"})  # a small one: on the loop
        assert status == 200 and r["count"] > 0, r
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        status, r = http(big_url + "/tokenize", "POST", {"messages": [{"role": "user", "content": "hi"}],
                                                         "tools": tools})
        assert status == 200 and r["count"] > 0, r  # the small lane is not the large one's work
    finally:
        gate.set()
    held[0].result(timeout=10)
    assert worker.depth == 0
    assert not any(n > 1000 for _, n in threads["encode"])  # the refused bodies were never encoded
    small = TokenizerWorker(small_jobs=2)  # the small lane: a count only
    gate, held = _hold(small, 2, small=True)
    try:
        with pytest.raises(TokenizerBusyError) as busy:
            small.submit(lambda: None, small=True)
        assert busy.value.retry_after_s >= 1
        small.submit(lambda: None, 10 << 20).result(timeout=10)  # the large lane is apart (and takes any one job)
    finally:
        gate.set()
    for job in held:
        job.result(timeout=10)
    worker.close()
    small.close()


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
            assert worker.depth == 2 and worker.large.bytes == len(BIG["prompt"])  # its text, not its body
        deadline = time.monotonic() + 5
        while worker.depth > 1 and time.monotonic() < deadline:  # dropped from the queue once seen gone
            time.sleep(0.02)
        assert worker.depth == 1 and worker.large.bytes == 0
    finally:
        gate.set()
    held[0].result(timeout=10)
    assert worker.depth == 0
    assert not any(n > 1000 for _, n in threads["encode"])  # the gone client's prompt was never encoded


@pytest.fixture()
def clock(monkeypatch) -> SimpleNamespace:
    """The worker's clock, moved by the jobs themselves: a job of n seconds takes none."""
    now = SimpleNamespace(t=0.0)
    monkeypatch.setattr(tokenizer_worker, "time", SimpleNamespace(monotonic=lambda: now.t))
    return now


def _fill(worker: TokenizerWorker, jobs: int, size: int, small: bool = False) -> tuple[threading.Event, int]:
    """Up to jobs gated jobs of size on a lane: (the gate, how many it took before refusing)."""
    gate, taken = threading.Event(), 0
    try:
        for _ in range(jobs):
            worker.submit(lambda: gate.wait(30), size, small=small)
            taken += 1
    except TokenizerBusyError as e:
        assert e.retry_after_s >= 1 and "busy" in e.message
    return gate, taken


def test_rates_resist_poisoning(clock):
    mb = 1 << 20
    worker = TokenizerWorker()
    for _ in range(40):  # 8 MB bodies of padding around "prompt": "hi" (were they sized by the body)
        worker.submit(lambda: None, 8 * mb).result(timeout=10)
    assert worker.large.rate == FIRST_RATE * RATE_SPAN
    gate, taken = _fill(worker, 2000, 8 * mb)  # then slow ones: a minute at the clamped rate, not 15 GB
    queued = worker.queued_s()
    gate.set()
    assert taken == 22 and queued <= 60 + 8 * mb / worker.large.rate  # the last one found a minute or less
    worker.close()

    def slow(seconds: float, fails: bool = False) -> Callable[[], None]:
        def run() -> None:
            clock.t += seconds
            if fails:
                raise ValueError("past the context")
        return run

    worker = TokenizerWorker()
    for _ in range(20):  # chats whose template grows: 3 s to render a 65 KB body (22 KB/s)
        worker.submit(slow(3.0), 65 * 1024, renders=True).result(timeout=10)
    assert worker.large.renders.rate == FIRST_RATE / RATE_SPAN and worker.large.rate == FIRST_RATE
    gate, taken = _fill(worker, 64, 70 * 1024)  # a burst of 70 KB prompts is not the renders' work
    gate.set()
    assert taken == 64
    job = worker.submit(slow(10.0, fails=True), 300_000)  # a failed job's time counts: 10 s for 300 KB
    with pytest.raises(ValueError):
        job.result(timeout=10)
    assert worker.large.rate < FIRST_RATE / 2
    worker.close()


def test_backstops_and_small_lane_time(clock):
    worker = TokenizerWorker(first_rate=1e12, large_bytes=1000, large_jobs=3)  # the time bound never binds
    gate = threading.Event()
    worker.submit(lambda: gate.wait(30), 10)
    with pytest.raises(TokenizerBusyError):
        worker.submit(lambda: None, 991)  # past 1000 characters queued
    worker.submit(lambda: None, 990)
    worker.submit(lambda: None, 0)
    with pytest.raises(TokenizerBusyError):
        worker.submit(lambda: None, 0)  # past 3 jobs
    gate.set()
    worker.close()
    worker = TokenizerWorker()
    for _ in range(20):  # renders on the small lane that take 2 s each (a template that grows)
        worker.submit(lambda: setattr(clock, "t", clock.t + 2.0), small=True, renders=True).result(timeout=10)
    gate, taken = _fill(worker, 1024, 0, small=True)
    gate.set()
    assert 28 <= taken <= 32  # about a minute of them, not 1024 (34 minutes)
    worker.close()
