"""What a hostile client meets at the HTTP layer: connections that never send a full request head are closed
after --timeout-keep-alive, the open-file limit is raised at start, accept failures and parser refusals are
logged as throttled one-liners, a body that does not decode as its Content-Encoding is a JSON 400 naming it,
an X-Request-Id the server rejects is never echoed, and a path update_weights_from_disk cannot load gets one
message whether it exists or not."""

from __future__ import annotations

import asyncio
import errno
import gzip
import logging
import resource
import socket
import time
from collections.abc import Iterator

import pytest
from gw_helpers import GATEWAY_ARGS, http, raw

from runtime.gateway.server import ServerHandle, _warn_if_open, serve_in_thread
from runtime.gateway.socket_guard import SocketGuard, _ParserErrors, _Throttle


@pytest.fixture(scope="module")
def quick_server() -> Iterator[ServerHandle]:
    """No engine behind it (/health: 503): the connection handling is what is tested."""
    with serve_in_thread(lambda: None, GATEWAY_ARGS.replace(timeout_keep_alive=0.5), port=0) as handle:
        yield handle


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_partial_heads_and_trickles_are_closed_after_the_keep_alive_timeout(quick_server):
    idle = [_connect(quick_server.url) for _ in range(20)]
    for sock in idle[:10]:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the head
    trickle = _connect(quick_server.url)
    start = time.monotonic()
    for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 40:  # a byte every 50 ms: never a full head
        try:
            trickle.sendall(bytes([byte]))
        except OSError:
            break
        time.sleep(0.05)
    assert _closed_by_server(trickle, 2.0) and time.monotonic() - start < 3.0
    assert all(_closed_by_server(sock, 2.0) for sock in idle)
    status, _ = http(quick_server.url + "/health")  # still answering (503: no engine behind it)
    assert status == 503
    for sock in (*idle, trickle):
        sock.close()


def test_the_open_file_limit_is_raised_to_65535_at_most():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 256)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        with serve_in_thread(lambda: None, GATEWAY_ARGS, port=0):
            raised = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]), hard))
    assert raised == (65535 if hard == resource.RLIM_INFINITY else min(hard, 65535))  # vLLM's and SGLang's target


def test_accept_failures_are_one_line_per_interval(caplog):
    now = [100.0]
    loop = asyncio.new_event_loop()
    seen: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    try:
        SocketGuard(interval_s=10.0, clock=lambda: now[0]).install(loop)
        full = OSError(errno.EMFILE, "Too many open files")
        with caplog.at_level(logging.ERROR, logger="shoal.gateway"):
            for _ in range(1000):
                loop.call_exception_handler({"message": "socket.accept() out of system resource", "exception": full})
            now[0] += 11
            loop.call_exception_handler({"message": "socket.accept() out of system resource", "exception": full})
            loop.call_exception_handler({"message": "something else", "exception": ValueError("x")})
    finally:
        loop.close()
    lines = [r for r in caplog.records if "cannot accept new connections" in r.getMessage()]
    assert len(lines) == 2 and "999 more times" in lines[1].getMessage() and not lines[0].exc_info
    assert [ctx["message"] for ctx in seen] == ["something else"]  # other errors reach the handler before


def test_parser_refusals_are_logged_without_tracebacks(quick_server, caplog):
    throttle, now = _Throttle(10.0, lambda: now[0]), [0.0]
    guard = _ParserErrors(throttle)
    from aiohttp.http_exceptions import LineTooLong

    def record() -> logging.LogRecord:
        exc = LineTooLong(b"a" * 100, 8190)
        return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                                 ("127.0.0.1",), (type(exc), exc, None))

    first = record()
    assert guard.filter(first) and first.exc_info is None and first.levelno == logging.WARNING
    assert "LineTooLong" in first.getMessage()
    assert not any(guard.filter(record()) for _ in range(5))
    now[0] = 20.0
    later = record()
    assert guard.filter(later) and "(5 more since" in later.getMessage()
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):  # through the live server: no traceback
        for headers in ({"X-Request-Id": "a" * 9000}, {"Content-Encoding": "br"}):
            status, got, body = raw(quick_server.url + "/v1/completions", "POST", headers, b"x")
            assert status == 400, body
    assert not [r for r in caplog.records if r.name == "aiohttp.server" and r.exc_info]


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/load_lora_adapter", "/resume_memory_occupation", "/invocations",
                                  "/debug/ttft_trace"])
def test_a_body_that_does_not_decode_is_a_400_naming_its_encoding(gw_url, path, encoding):
    status, body = http(gw_url + path, "POST", b"garbage", {"Content-Encoding": encoding})
    assert status == 400, body
    assert body["error"]["param"] == "Content-Encoding" and repr(encoding) in body["error"]["message"]


def test_a_gzip_body_that_decodes_is_served(gw_url):
    payload = b'{"prompt": "hi", "max_tokens": 2, "temperature": 0}'
    status, body = http(gw_url + "/v1/completions", "POST", gzip.compress(payload), {"Content-Encoding": "gzip"})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_a_rejected_request_id_is_not_echoed(gw_url):
    for bad in ("a" * 4000, "a b", "a\tb"):
        status, headers, _ = raw(gw_url + "/v1/models", headers={"X-Request-Id": bad})
        assert status == 200 and headers["X-Request-Id"] != bad and len(headers["X-Request-Id"]) == 32
        status, headers, _ = raw(gw_url + "/v1/completions", "POST", {"X-Request-Id": bad,
                                 "Content-Type": "application/json"}, b'{"prompt": "hi", "max_tokens": 1}')
        assert status == 400 and headers["X-Request-Id"] != bad
    good = "req-" + "x" * 200
    assert raw(gw_url + "/v1/models", headers={"X-Request-Id": good})[1]["X-Request-Id"] == good


def test_update_path_errors_do_not_say_which_paths_exist(gw_url, tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    messages = set()
    for name in ("absent", "folder", "file"):
        path = str(tmp_path / name)
        status, body = http(gw_url + "/update_weights_from_disk", "POST", {"model_path": path})
        assert status == 400 and body["success"] is False
        messages.add(body["message"].replace(path, "PATH"))
    assert messages == {"model_path 'PATH' is not a checkpoint folder this server can load"}


def test_an_open_bind_without_keys_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="shoal.gateway"):
        for host in ("127.0.0.1", "::1", "localhost"):
            _warn_if_open(host, GATEWAY_ARGS)
        _warn_if_open("0.0.0.0", GATEWAY_ARGS.replace(api_key=("k",)))
        _warn_if_open("0.0.0.0", GATEWAY_ARGS.replace(admin_api_key="adm"))
        assert not caplog.records
        for host in ("0.0.0.0", "10.1.2.3", "myhost.example"):
            _warn_if_open(host, GATEWAY_ARGS)
    assert len(caplog.records) == 3 and "no --api-key or --admin-api-key" in caplog.records[0].getMessage()
