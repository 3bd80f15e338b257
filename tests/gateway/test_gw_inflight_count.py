"""GatewayState.active (the choices in flight, against --max-concurrent-requests; the drain waits on it)
returns to 0 after each way a hostile client ends a generation: a stream dropped mid-way (FIN or RST, one
choice or n), a stream dropped before its first byte, a non-streaming request dropped while it runs, a
client that stops reading (its slot is held while it stays connected, freed when it leaves), and requests
refused after they were counted (admission's 400) or at the limit (429). A leak here would cut the
server's capacity for good.

A stream dropped before its headers went out was a 500 with an "unhandled error" traceback (aiohttp's
"Cannot write to closing transport" from the headers' write): the client left, so it is logged 499."""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
from collections.abc import Iterator

import pytest
from gw_helpers import GATEWAY_ARGS, http, slow_steps, wait_kv_full
from log_lines import LogLines

from runtime import Engine
from runtime.gateway.server import ServerHandle, serve_in_thread
from runtime.gateway.state import STATE_KEY, GatewayState

LONG = 400  # tokens: outlives every client action below (slow_steps)
STREAMS = {
    "completions_n2": ("/v1/completions", {"prompt": "Tell me a story", "max_tokens": LONG, "ignore_eos": True,
                                            "stream": True, "n": 2}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}],
                                      "max_tokens": LONG, "ignore_eos": True, "stream": True}),
    "generate": ("/generate", {"text": "Tell me a story", "stream": True,
                               "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}),
    "responses": ("/v1/responses", {"input": "Tell me a story", "max_output_tokens": LONG, "ignore_eos": True,
                                    "stream": True}),
}


@pytest.fixture(scope="module")
def server(gw_engine: Engine) -> Iterator[ServerHandle]:
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(max_concurrent_requests=2), port=0) as handle:
        yield handle
    wait_kv_full(gw_engine)


def _state(server: ServerHandle) -> GatewayState:
    return server.app[STATE_KEY]


def _send(server: ServerHandle, path: str, body: dict, rcvbuf: int = 0) -> socket.socket:
    """A raw connection that sent the request: the test decides how the client leaves."""
    host, port = server.url.rsplit("/", 1)[-1].split(":")
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect((host, int(port)))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _settled(state: GatewayState) -> bool:
    return state.active == 0 and not state.inflight


def _leave(s: socket.socket, reset: bool) -> None:
    if reset:  # SO_LINGER 0: close sends an RST
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
@pytest.mark.parametrize("kind", list(STREAMS))
def test_stream_dropped_mid_way(server, gw_engine, monkeypatch, kind, reset):
    slow_steps(gw_engine, monkeypatch, 0.005)
    state = _state(server)
    path, body = STREAMS[kind]
    s = _send(server, path, body)
    assert s.recv(1)  # the 200 headers are out: the stream runs
    assert state.active == body.get("n", 1)
    _leave(s, reset)
    assert _until(lambda: _settled(state)), (state.active, state.inflight)


@pytest.mark.parametrize("kind", list(STREAMS))
def test_stream_dropped_before_its_first_byte(server, gw_engine, monkeypatch, kind):
    slow_steps(gw_engine, monkeypatch, 0.005)
    state = _state(server)
    path, body = STREAMS[kind]
    # Shoal's loggers may not propagate to caplog's root (setup_logging, once any test ran it): listen on them
    access, errors = LogLines(), LogLines(logging.ERROR)
    shoal = [logging.getLogger("shoal"), logging.getLogger("runtime"), logging.getLogger()]  # root: aiohttp's
    level = shoal[0].level
    shoal[0].setLevel(logging.INFO)
    logging.getLogger("shoal.access").addHandler(access)
    for log in shoal:
        log.addHandler(errors)
    try:
        s = _send(server, path, body)
        s.shutdown(socket.SHUT_WR)  # gone before the handler answers: its headers' write finds a closing transport
        s.close()
        assert _until(lambda: _settled(state)), (state.active, state.inflight)
        logged = f"POST {path} HTTP/1.1\" 499 "  # the access line follows the handler's end
        assert _until(lambda: any(logged in m for m in access.messages)), access.messages
        assert not errors.messages, errors.messages
    finally:
        logging.getLogger("shoal.access").removeHandler(access)
        for log in shoal:
            log.removeHandler(errors)
        shoal[0].setLevel(level)


def test_non_stream_dropped_while_running(server, gw_engine, monkeypatch):
    slow_steps(gw_engine, monkeypatch, 0.005)
    state = _state(server)
    s = _send(server, "/v1/completions", {"prompt": "Tell me a story", "max_tokens": LONG, "ignore_eos": True})
    assert _until(lambda: state.active == 1)
    _leave(s, reset=False)
    assert _until(lambda: _settled(state)), (state.active, state.inflight)


def test_a_client_that_stops_reading_loses_its_slot_after_the_stall_limit(server, gw_engine, monkeypatch):
    """/generate's events each carry the whole answer so far (and its logprobs): a client with a small
    receive buffer that never reads stalls the handler's writes after the engine is done. Its slot stays in
    flight while a write waits, then SEND_STALL_S (nginx's send_timeout) drops the connection and frees it,
    though the client never left."""
    from runtime.gateway import sse

    monkeypatch.setattr(sse, "SEND_STALL_S", 1.0)
    state = _state(server)
    body = {"text": "Tell me a story", "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    s = _send(server, "/generate", body, rcvbuf=2048)
    assert _until(lambda: state.active == 1)

    def engine_idle() -> bool:
        with gw_engine.scheduler.lock:
            return not gw_engine.scheduler.reqs

    # Megabytes of events against kilobytes of buffers: the writes wait on the client until the stall limit
    # drops it (ended or aborted, the engine is idle then), though the client never left
    assert _until(engine_idle, 30)
    assert _until(lambda: _settled(state), 10), (state.active, state.inflight)
    _leave(s, reset=False)


def test_a_slow_reader_gets_more_time_and_a_stalled_one_is_dropped():
    """The stall limit counts from the client's last progress (nginx's send_timeout): a client that read
    anything since (the transport's buffer went under the write's mark) gets another SEND_STALL_S, within the
    stream's STALL_BUDGET_S (a byte-a-minute reader would hold its slot for hours)."""
    import asyncio
    from types import SimpleNamespace

    from runtime.gateway.sse import SEND_STALL_S, STALL_BUDGET_S, SseWriter

    class Transport:
        held, aborted = 0, False

        def get_write_buffer_size(self) -> int:
            return self.held

        def abort(self) -> None:
            self.aborted = True

        def is_closing(self) -> bool:
            return self.aborted

    async def run() -> None:
        t = Transport()
        w = SseWriter(SimpleNamespace(transport=t))
        t.held = 50_000
        w._arm(1_000)  # the mark: 51,000 bytes held once the frame is queued
        t.held = 50_900  # the client read 100 bytes of it
        w._stalled()
        assert not t.aborted and w._stall is not None  # re-armed
        w._stalled()  # nothing read since
        assert t.aborted
        w._disarm()
        t = Transport()  # a client that always reads a little: another SEND_STALL_S, until the stream's budget
        w = SseWriter(SimpleNamespace(transport=t))
        t.held = 50_000
        w._arm(1_000)
        periods = 0
        while not t.aborted:
            t.held -= 1
            w._armed_at -= SEND_STALL_S  # the write has waited one more period
            w._stalled()
            periods += 1
        assert periods == STALL_BUDGET_S // SEND_STALL_S
        w._disarm()
        t = Transport()  # writes that each end under SEND_STALL_S count against the budget too
        w = SseWriter(SimpleNamespace(transport=t))
        for _ in range(int(STALL_BUDGET_S // 50)):
            w._arm(1_000)
            w._armed_at -= 50  # this write waited 50 s, then went out
            w._disarm()
        w._arm(1_000)
        w._stalled()  # the next write that has to wait at all: the budget is spent
        assert t.aborted
        w._disarm()

    asyncio.run(run())


def test_refusals_after_counting_free_their_places(server, gw_engine, monkeypatch):
    slow_steps(gw_engine, monkeypatch, 0.005)
    state = _state(server)
    path, body = STREAMS["completions_n2"]
    holder = _send(server, path, body)  # both places of --max-concurrent-requests 2
    assert holder.recv(1) and state.active == 2
    status, r = http(server.url + "/v1/completions", "POST", {"prompt": "hi", "max_tokens": 2})
    assert status == 429, r
    assert state.active == 2
    _leave(holder, reset=False)
    assert _until(lambda: _settled(state)), (state.active, state.inflight)
    # Admission's 400 comes after track (a batch past --max-waiting-requests): untracked on the way out.
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(max_waiting_requests=1), port=0) as small:
        status, r = http(small.url + "/v1/completions", "POST", {"prompt": "hi", "max_tokens": 2, "n": 2})
        assert status == 400 and r["error"]["param"] == "prompt", r
        assert _settled(_state(small))
    status, r = http(server.url + "/v1/completions", "POST", {"prompt": "hi", "max_tokens": 2, "n": 2})
    assert status == 200 and len(r["choices"]) == 2, r  # every place is free again
    assert _settled(state)
