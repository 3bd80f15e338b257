"""The access log (one line per HTTP request: method, path, status, request id, latency; on by default as
uvicorn's in vLLM, off with --disable-access-log / vLLM's --disable-uvicorn-access-log, paths left out with
--disable-access-log-for-endpoints) and --enable-log-requests (each prompt once: its sampling params at INFO
and, at DEBUG, the prompt as the model reads it, cut to --max-log-len), and their vLLM flags on the command
line."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest
from gw_helpers import GATEWAY_ARGS, http

from runtime.cli import build_parser, server_args
from runtime.errors import ServerArgsError
from runtime.gateway.server import serve_in_thread

_LINE = re.compile(r'(\S+) "(\w+) (\S+) HTTP/1\.1" (\d{3}) (\S+) (\d+\.\d) ms')


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def lines() -> Iterator[dict[str, _Lines]]:
    """The lines of the access log (INFO) and the request log (DEBUG: its prompt lines too), by logger."""
    handlers, levels = {}, {}
    for name in ("shoal.access", "shoal.requests"):
        log, handlers[name] = logging.getLogger(name), _Lines()
        levels[name] = log.level
        log.addHandler(handlers[name])
        log.setLevel(logging.DEBUG if name == "shoal.requests" else logging.INFO)
    yield handlers
    for name, handler in handlers.items():
        logging.getLogger(name).removeHandler(handler)
        logging.getLogger(name).setLevel(levels[name])


def _access(lines: dict[str, _Lines]) -> list[tuple[str, str, str, int, str]]:
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
        assert http(server.url + "/health")[0] == 200  # left out, as /metrics
        assert http(server.url + "/metrics")[0] == 200
    access = _access(lines)
    assert [a[:3] for a in access] == [("POST", "/v1/completions", 200), ("POST", "/v1/chat/completions", 200),
                                       ("POST", "/v1/completions", 400), ("GET", "/no/such/route", 404)]
    assert access[0][3] == "cmpl-trace-7-0"  # the first engine request's rid: the response id and its choice
    assert access[1][3].startswith("chatcmpl-") and access[1][4] == "127.0.0.1"
    assert access[2][3] == access[3][3] == "-"
    # Each prompt once (the n=2 choices share it): its params at INFO; at DEBUG (user data, as vLLM logs it)
    # the prompt as the model reads it, cut to --max-log-len characters.
    received = lines["shoal.requests"].messages
    assert len(received) == 4 and received[0].startswith("Received request cmpl-trace-7-0: params: ")
    ids = gw_engine.tokenizer.encode(prompt)
    expected = gw_engine.tokenizer.decode(ids, skip_special_tokens=False)[:12]
    assert received[1] == f"Request cmpl-trace-7-0 prompt: {expected!r}"
    assert f"prompt_tokens: {len(ids)}, " in received[0] and prompt not in received[0]
    assert "params: SamplingParams(max_new_tokens=3, temperature=0.0)" in received[0]
    assert received[2].startswith("Received request chatcmpl-") and received[3].startswith("Request chatcmpl-")


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
