"""Nothing a client sends can forge a log line or a field of one: SGLang's body rid (/generate, /encode and
/abort_request) must have a client id's form (request_ids.py: 1-256 visible ASCII characters; an engine rid
made from one may be longer for /abort_request), else a 400 naming rid; the access log prints X-Request-Id
only in that form (the header its answer carried: a bad one is never echoed but answered with an id drawn
for it), a keyless caller's 401 line included; the request log quotes the rid (repr)."""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Iterator

import pytest
from gw_helpers import GATEWAY_ARGS, http, raw

from runtime.gateway.errors import ApiError
from runtime.gateway.native_routes import _encode_rids
from runtime.gateway.request_ids import well_formed_id
from runtime.gateway.server import ServerHandle, serve_in_thread

FORGED = 'x\n6.6.6.6 "POST /v1/admin HTTP/1.1" 200 forged 1.0 ms'
_HEX_ID = re.compile(r"[0-9a-f]{32}")  # an id the gateway drew (uuid4 hex)
BAD_RIDS = [FORGED, "two words", "", "x" * 257, "caf\u00e9", "tab\there"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def access(self, request_line: str) -> str:
        """The one access line of request_line ("GET /path") logged since the lines were cleared: it comes once
        the answer is written, so maybe after the client read it."""
        head, deadline = f'127.0.0.1 "{request_line} HTTP/1.1" ', time.monotonic() + 5
        while not any(line.startswith(head) for line in self.lines):
            assert time.monotonic() < deadline, self.lines
            time.sleep(0.005)
        [line] = [line for line in self.lines if line.startswith(head)]
        return line[len(head):]


@pytest.fixture(scope="module")
def logged(gw_engine) -> Iterator[tuple[ServerHandle, _Records]]:
    """A keyed server logging requests, and every line of its access and request logs."""
    records, loggers = _Records(), [logging.getLogger(n) for n in ("shoal.access", "shoal.requests")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.addHandler(records)
        log.setLevel(logging.DEBUG)
    args = GATEWAY_ARGS.replace(enable_log_requests=True, api_key=("sk-k",))
    with serve_in_thread(gw_engine, args, port=0) as server:
        yield server, records
    for log, level in zip(loggers, levels):
        log.removeHandler(records)
        log.setLevel(level)


KEY = {"Authorization": "Bearer sk-k"}


def test_the_id_form():
    assert well_formed_id("trace-7") and well_formed_id("x" * 256) and well_formed_id('a"b')
    assert not any(well_formed_id(rid) for rid in BAD_RIDS)


def test_generate_rid_is_checked(logged):
    server, records = logged
    for rid in BAD_RIDS:
        records.lines.clear()
        status, body = http(server.url + "/generate", "POST", {"text": "hi", "rid": rid,
                                                               "sampling_params": {"max_new_tokens": 1}}, headers=KEY)
        assert status == 400 and body["error"]["param"] == "rid", (rid, body)
        assert _HEX_ID.fullmatch(records.access("POST /generate").split()[1])  # the header drawn for the 400
    records.lines.clear()
    status, headers, got = raw(server.url + "/generate", "POST", {**KEY, "Content-Type": "application/json"},
                               b'{"text": "hi", "rid": "fine-rid", "sampling_params": {"max_new_tokens": 1}}')
    assert status == 200 and b'"id":"fine-rid"' in got
    access, received = records.access("POST /generate"), records.lines[0]
    assert received.startswith("Received request 'fine-rid': params: ")  # quoted, as the prompt is
    assert headers["X-Request-Id"] == "fine-rid" and access.startswith("200 fine-rid ")  # the body's rid names it


def test_abort_rid_is_checked(logged):
    server, _ = logged
    for rid in (FORGED, "", "two words", "x" * 513):
        status, body = http(server.url + "/abort_request", "POST", {"rid": rid}, headers=KEY)
        assert status == 400 and body["error"]["param"] == "rid", (rid, body)
    # An engine rid made from a 256-character client id is longer than one: still abortable by it.
    engine_rid = "chatcmpl-" + "x" * 256 + "-0"
    assert http(server.url + "/abort_request", "POST", {"rid": engine_rid}, headers=KEY) == (
        200, {"aborted": [engine_rid]})


def test_encode_rids_are_checked():
    """/encode's rid (a string, or one per input), checked before the route needs an embedding model."""
    assert _encode_rids(None, 2, True, "embd-f") == ("embd-f", ["embd-f-0", "embd-f-1"])
    assert _encode_rids("mine", 1, False, "embd-f") == ("mine", ["mine"])
    assert _encode_rids(["a", "b"], 2, True, "embd-f") == ("embd-f", ["a", "b"])
    for rid in [*BAD_RIDS, ["ok", FORGED], ["ok", ""], ["ok", "ok"]]:
        with pytest.raises(ApiError) as info:
            _encode_rids(rid, 2, True, "embd-f")
        assert info.value.status == 400 and info.value.param == "rid", rid


def test_access_log_prints_only_a_well_formed_header(logged):
    """A keyless caller's X-Request-Id cannot forge fields of its own 401 line: shown only with an id's form,
    else the id drawn for the answer's header instead."""
    server, records = logged
    spoof = 'x 1.0 ms | 10.0.0.9 "DELETE /v1/models HTTP/1.1" 200 ok'
    for header in (spoof, "x" * 257, "trace-9"):
        records.lines.clear()
        status, headers, _ = raw(server.url + "/v1/models", headers={"X-Request-Id": header})
        answered = headers["X-Request-Id"]
        assert status == 401 and (answered == header) == (header == "trace-9"), answered
        line = records.access("GET /v1/models")
        assert line.startswith(f"401 {answered} "), line
    # The path is logged as sent (percent-encoded): a %0a in it stays three characters.
    records.lines.clear()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /nope%0a9.9.9.9%20x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 401")
    assert _HEX_ID.fullmatch(records.access("GET /nope%0a9.9.9.9%20x").split()[1])
