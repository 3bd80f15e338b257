"""Over HTTP, hostile grammars are 400s naming the body field that gave them: too large (a 100k-value
enum answers at once), a $ref to a URL, a grammar that matches no text (at compile), and one that
dead-ends after its first token; a 100k-value enum is refused alike (at the step that finds it, naming the grammar).
A client that leaves while its grammar waits for a compile thread has the compile dropped."""

from __future__ import annotations

import json
import time

import pytest
from grammar_hogs import recorded_compiles
from gw_helpers import http

pytest.importorskip("xgrammar")

NESTED: dict = {"type": "integer"}
for _ in range(70):
    NESTED = {"type": "array", "items": NESTED}
P = {"model": "llama", "prompt": "Hi", "max_tokens": 4}


@pytest.mark.parametrize(("extra", "param", "code", "says"), [
    # within the test gateway's 64 KiB body limit (a 100k-value enum is refused by size alike)
    ({"json_schema": json.dumps(NESTED)}, "json_schema", "grammar_too_large", "too large"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "http://169.254.169.254/x"}}}}}},
     "response_format.json_schema.schema", "invalid_grammar", "only local $ref"),
    ({"guided_json": {"$ref": "file:///etc/passwd"}}, "guided_json", "invalid_grammar", "only local $ref"),
    ({"ebnf": "root ::= root"}, "ebnf", "invalid_grammar", "matches no text"),
    ({"ebnf": 'root ::= "a" b\nb ::= b'}, "ebnf", "invalid_value", "cannot be completed"),
])
def test_hostile_grammars_are_400_naming_the_field(gw_url, extra, param, code, says):
    t0 = time.monotonic()
    status, err = http(gw_url + "/v1/completions", "POST", {**P, **extra})
    assert status == 400 and err["error"]["param"] == param and err["error"]["code"] == code, err
    assert says in err["error"]["message"] and time.monotonic() - t0 < 5, err
    status, body = http(gw_url + "/v1/completions", "POST", {**P, "regex": "[0-9]{3}"})
    assert status == 200 and body["choices"][0]["text"].isdigit(), body


def test_a_busy_compile_pool_is_a_503_with_retry_after():
    from runtime.gateway.errors import from_shoal_error
    from runtime.sampling.grammar_compiler import GrammarBusyError

    err = from_shoal_error(GrammarBusyError("grammar compiler is busy", retry_after_s=2.4))
    assert err.status == 503 and err.headers == {"Retry-After": "3"}
    assert err.body().error.code == "grammar_compiler_busy"


def test_a_client_gone_while_its_grammar_waits_drops_the_compile(gw_engine, gw_server, monkeypatch):
    """aiohttp does not cancel a handler whose client left: the grammar check looks for a closed connection
    itself, so the compile it queued (behind two that hold the pool's threads) is dropped within a poll,
    never compiled, instead of waiting out its deadline."""
    import socket
    import threading

    g, gate = gw_engine.grammar, threading.Event()
    calls = recorded_compiles(g, gate, monkeypatch)
    hogs = [g.submit(("regex", f"hog-gone{i}")) for i in range(2)]  # the engine's two compile threads
    try:
        body = json.dumps({**P, "regex": "gone-client[0-9]"}).encode()
        host, port = gw_server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 5
            while g.queued < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert g.queued == 1  # its compile waits for a thread
        deadline = time.monotonic() + 3  # the queue wait's own deadline is 5 s or more
        while g.queued and time.monotonic() < deadline:
            time.sleep(0.01)
        assert g.queued == 0
    finally:
        gate.set()
        for job in hogs:
            g.leave(job)
    time.sleep(0.1)
    assert not any(t.startswith("gone-client") for t in calls), calls
