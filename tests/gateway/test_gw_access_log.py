"""The access log (one line per HTTP request: method, path, status, request id, latency; on by default as
uvicorn's in vLLM, off with --disable-access-log / vLLM's --disable-uvicorn-access-log, paths left out with
--disable-access-log-for-endpoints) and --enable-log-requests (each prompt once: its sampling params at INFO
and, at DEBUG, the prompt as the model reads it, cut to --max-log-len), and their vLLM flags on the command
line. A client that leaves before its whole answer (or a stream's last event) is logged 499."""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections.abc import Iterator

import pytest
from gw_helpers import GATEWAY_ARGS, http, raw, slow_steps, wait_kv_full
from log_lines import LogLines

from runtime.cli import build_parser, server_args
from runtime.errors import ServerArgsError
from runtime.gateway.app import build_app
from runtime.gateway.server import serve_in_thread

_HEX_ID = re.compile(r"[0-9a-f]{32}")  # an id the gateway drew (uuid4 hex)
_LINE = re.compile(r'(\S+) "(\w+) (\S+) HTTP/1\.1" (\d{3}) (\S+) (\d+\.\d) ms')


@pytest.fixture
def lines() -> Iterator[dict[str, LogLines]]:
    """The lines of the access log (INFO) and the request log (DEBUG: its prompt lines too), by logger."""
    handlers, levels = {}, {}
    for name in ("shoal.access", "shoal.requests"):
        log, handlers[name] = logging.getLogger(name), LogLines()
        levels[name] = log.level
        log.addHandler(handlers[name])
        log.setLevel(logging.DEBUG if name == "shoal.requests" else logging.INFO)
    yield handlers
    for name, handler in handlers.items():
        logging.getLogger(name).removeHandler(handler)
        logging.getLogger(name).setLevel(levels[name])


def _access(lines: dict[str, LogLines]) -> list[tuple[str, str, str, int, str]]:
    """(method, path, status, id, ...) of each access line."""
    out = []
    for message in lines["shoal.access"].messages:
        m = _LINE.fullmatch(message)
        assert m is not None, message
        out.append((m[2], m[3], int(m[4]), m[5], m[1]))
    return out


def test_access_and_request_lines(gw_engine, lines):
    args = GATEWAY_ARGS.replace(enable_log_requests=True, max_log_len=12,
                                disable_access_log_for_endpoints="/health,/metrics/")
    prompt = "The capital of France is"
    with serve_in_thread(gw_engine, args, port=0) as server:
        status, body = http(server.url + "/v1/completions", "POST",
                            {"prompt": prompt, "max_tokens": 3, "temperature": 0, "n": 2},
                            headers={"X-Request-Id": "trace-7"})
        assert status == 200 and body["id"] == "cmpl-trace-7"
        status, text = http(server.url + "/v1/chat/completions", "POST", {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True})
        assert status == 200 and text.rstrip().endswith("[DONE]")
        assert http(server.url + "/v1/completions", "POST", {"prompt": "hi", "max_tokens": -1})[0] == 400
        assert http(server.url + "/no/such/route")[0] == 404
        status, headers, _ = raw(server.url + "/v1/models")
        assert status == 200
        assert http(server.url + "/health")[0] == 200  # left out, as /metrics
        assert http(server.url + "/metrics")[0] == 200
    access = _access(lines)
    assert [a[:3] for a in access] == [("POST", "/v1/completions", 200), ("POST", "/v1/chat/completions", 200),
                                       ("POST", "/v1/completions", 400), ("GET", "/no/such/route", 404),
                                       ("GET", "/v1/models", 200)]
    # Each request by the X-Request-Id its answer carried: the client's own, else the id its response id was
    # made from (chatcmpl-<id>), else (a GET, an error before any id) the one drawn for the header.
    assert access[0][3] == "trace-7"
    assert _HEX_ID.fullmatch(access[1][3]) and f'"id":"chatcmpl-{access[1][3]}"' in text
    assert access[1][4] == "127.0.0.1"
    assert all(_HEX_ID.fullmatch(a[3]) for a in access[2:]) and access[4][3] == headers["X-Request-Id"]
    # Each prompt once (the n=2 choices share it): its params at INFO; at DEBUG (user data, as vLLM logs it)
    # the prompt as the model reads it, cut to --max-log-len characters.
    received = lines["shoal.requests"].messages
    assert len(received) == 4 and received[0].startswith("Received request 'cmpl-trace-7-0': params: ")
    ids = gw_engine.tokenizer.encode(prompt)
    expected = gw_engine.tokenizer.decode(ids, skip_special_tokens=False)[:12]
    assert received[1] == f"Request 'cmpl-trace-7-0' prompt: {expected!r}"
    assert f"prompt_tokens: {len(ids)}, " in received[0] and prompt not in received[0]
    assert "params: SamplingParams(max_new_tokens=3, temperature=0.0)" in received[0]
    assert received[2].startswith("Received request 'chatcmpl-") and received[3].startswith("Request 'chatcmpl-")


def test_generate_choices_logged_once(gw_engine, lines):
    """/generate's n choices of a prompt are logged once (by the first's rid); each prompt of a batch is logged,
    equal prompts too (they are two prompts)."""
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(enable_log_requests=True), port=0) as server:
        for body in ({"text": "hello there", "rid": "one", "sampling_params": {"n": 3, "max_new_tokens": 2}},
                     {"input_ids": [[1, 2, 3], [1, 2, 3]], "rid": "two",
                      "sampling_params": {"n": 2, "max_new_tokens": 1}}):
            assert http(server.url + "/generate", "POST", body)[0] == 200
    received = [m.split(":")[0] for m in lines["shoal.requests"].messages if m.startswith("Received")]
    assert received == ["Received request 'one-0'", "Received request 'two-0'", "Received request 'two-2'"]


def test_log_requests_setting_says_where_prompts_go(caplog):
    with caplog.at_level(logging.INFO, logger="shoal.gateway"):
        build_app(lambda: None, GATEWAY_ARGS.replace(enable_log_requests=True, max_log_len=9))
    [said] = [r.getMessage() for r in caplog.records if "--enable-log-requests" in r.getMessage()]
    assert "sampling params at INFO" in said and "prompt (up to 9 characters) at DEBUG" in said


def _leave_early(port: int, body: dict, read_first: bool) -> None:
    """POSTs /v1/completions on a raw socket and closes it: after the stream's first bytes, or at once."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        got = b""
        while read_first and b"data: " not in got:  # the headers come first, then the first event
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk


def test_client_gone_is_499(gw_engine, lines, monkeypatch):
    """nginx's 499 when the client leaves first: a stream cut after its first event (its handler returns a
    200 response it could not finish), and a whole answer it left before (the handler's 503: aborted)."""
    slow_steps(gw_engine, monkeypatch, 0.05)  # 40 tokens: 2 s unless the request is aborted
    body = {"prompt": "hi", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with serve_in_thread(gw_engine, GATEWAY_ARGS, port=0) as server:
        port = int(server.url.rsplit(":", 1)[1])
        start = time.monotonic()
        _leave_early(port, {**body, "stream": True}, read_first=True)
        _leave_early(port, body, read_first=False)
        while len(lines["shoal.access"].messages) < 2:
            assert time.monotonic() - start < 10, lines["shoal.access"].messages
            time.sleep(0.02)
        assert time.monotonic() - start < 1.8  # both aborted, not run to their end
        status, done = http(server.url + "/v1/completions", "POST", {**body, "max_tokens": 2, "stream": True})
        assert status == 200 and done.rstrip().endswith("[DONE]")
    access = _access(lines)
    assert [a[:3] for a in access] == [("POST", "/v1/completions", 499)] * 2 + [("POST", "/v1/completions", 200)]
    # The id the response id was made from (cmpl-<id>): sent as X-Request-Id, or that it would have carried.
    assert all(_HEX_ID.fullmatch(a[3]) for a in access)
    wait_kv_full(gw_engine)


def test_access_log_off(gw_engine, lines):
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(disable_access_log=True), port=0) as server:
        assert http(server.url + "/v1/models")[0] == 200
        assert http(server.url + "/v1/completions", "POST", {"prompt": "hi", "max_tokens": 1})[0] == 200
    assert lines["shoal.access"].messages == [] and lines["shoal.requests"].messages == []


def _serve(*argv: str):
    return server_args(build_parser().parse_args(["serve", "/m", *argv]))


def test_vllm_flags_of_the_logs():
    args = _serve("--enable-log-requests", "--max-log-len", "100", "--disable-uvicorn-access-log",
                  "--disable-access-log-for-endpoints", "/health,/ping", "--enable-server-load-tracking")
    assert args.enable_log_requests and args.max_log_len == 100 and args.disable_access_log
    assert args.disable_access_log_for_endpoints == "/health,/ping" and args.enable_server_load_tracking
    assert _serve("--no-enable-log-requests", "--no-disable-uvicorn-access-log") == _serve()
    for argv, flag in ((["--max-log-len", "-1"], "--max-log-len"),
                       (["--disable-access-log-for-endpoints", "health"], "--disable-access-log-for-endpoints"),
                       (["--enable-log-requests", "--disable-log-requests"], "--disable-log-requests")):
        with pytest.raises(ServerArgsError) as info:
            _serve(*argv)
        assert info.value.flag == flag, argv
