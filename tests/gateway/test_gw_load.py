"""Load routes: vLLM's GET /load ({"server_load": HTTP requests in flight on the model's routes, 0 without
--enable-server-load-tracking}) and SGLang's GET /get_load (one entry per replica that is up: its running and
waiting requests, KV held plus prompt tokens to prefill, and the latter alone; 503 when none is). Checked on
a small app with only the routes they need, against the live tiny-Llama engine, and on the real app."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from aiohttp import web
from gw_helpers import GATEWAY_ARGS, http, slow_steps

from runtime import ServerArgs
from runtime.gateway.load_routes import add_routes
from runtime.gateway.openai_chat import chat_completions
from runtime.gateway.server import ServerHandle, serve_in_thread
from runtime.gateway.state import STATE_KEY, GatewayState
from runtime.messages import SchedulerStats


class _Tracking:
    """ServerArgs with enable_server_load_tracking set, for a ServerArgs that does not have the flag yet."""

    def __init__(self, args: ServerArgs, on: bool):
        self._args, self.enable_server_load_tracking = args, on

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)


def tracking(on: bool) -> Any:
    if "enable_server_load_tracking" in {f.name for f in dataclasses.fields(ServerArgs)}:
        return GATEWAY_ARGS.replace(enable_server_load_tracking=on)
    return _Tracking(GATEWAY_ARGS, on)


def small_app(client: Any, args: Any) -> web.Application:
    app = web.Application()
    app[STATE_KEY] = GatewayState(client, args)
    app.router.add_post("/v1/chat/completions", chat_completions)
    add_routes(app)
    return app


@pytest.fixture()
def serve(gw_engine) -> Iterator[Any]:
    handles: list[ServerHandle] = []

    def start(on: bool, client: Any = gw_engine) -> ServerHandle:
        handles.append(ServerHandle(small_app(client, tracking(on)), "127.0.0.1", 0))
        return handles[-1]

    yield start
    for h in handles:
        h.stop()


def stream(url: str, n: int = 1) -> Iterator[Any]:
    """A chat stream, its first chunk already read (the request is admitted and running)."""
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = iter(oai.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=40, n=n, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    next(chunks)
    return chunks


def server_load(url: str) -> int:
    status, body = http(url + "/load")
    assert status == 200 and set(body) == {"server_load"}, body
    return body["server_load"]


def settles_at(url: str, want: int) -> None:
    deadline = time.monotonic() + 10
    while server_load(url) != want:  # the handler untracks once the stream's last event is sent
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_load_counts_requests_in_flight(serve, gw_engine, monkeypatch):
    h = serve(True)
    assert server_load(h.url) == 0
    slow_steps(gw_engine, monkeypatch, 0.02)  # 40 steps: the streams outlive the checks
    a = stream(h.url, n=2)
    b = stream(h.url)
    # Requests, not choices: vLLM's count is of HTTP requests (three choices run).
    assert server_load(h.url) == 2 and h.app[STATE_KEY].active == 3
    assert sum(1 for _ in a) > 0
    settles_at(h.url, 1)
    assert sum(1 for _ in b) > 0
    settles_at(h.url, 0)


def test_load_is_zero_without_tracking(serve, gw_engine, monkeypatch):
    h = serve(False)
    slow_steps(gw_engine, monkeypatch, 0.02)
    s = stream(h.url)
    assert server_load(h.url) == 0 and h.app[STATE_KEY].active == 1  # running, not counted: vLLM's 0
    assert sum(1 for _ in s) > 0


class _Replicas:
    """A ready client over three replicas, the second one down."""

    def __init__(self, replicas: list[SchedulerStats | None]):
        self.replicas = replicas

    def is_ready(self) -> bool:
        return True

    async def replica_stats(self) -> list[SchedulerStats | None]:
        return self.replicas


def test_get_load_per_replica(serve):
    r0 = SchedulerStats(num_running_reqs=3, num_queue_reqs=2, num_used_tokens=700, waiting_tokens=150)
    r2 = SchedulerStats(num_running_reqs=1, num_used_tokens=40)
    h = serve(False, lambda: _Replicas([r0, None, r2]))
    before = time.perf_counter()
    status, body = http(h.url + "/get_load")
    assert status == 200
    assert [{k: v for k, v in e.items() if k != "ts_tic"} for e in body] == [
        {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 850, "num_pending_tokens": 150},
        {"dp_rank": 2, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 40, "num_pending_tokens": 0}]
    assert before <= body[0]["ts_tic"] == body[1]["ts_tic"] <= time.perf_counter()  # one clock, this process's


def test_get_load_with_every_replica_down():
    """No replica up is not an idle server (a router would send there): 503 engine_not_ready, as while loading
    (the real app: its middleware answers the error)."""
    with serve_in_thread(lambda: _Replicas([None, None]), GATEWAY_ARGS, port=0) as h:
        status, body = http(h.url + "/get_load")
    assert status == 503 and body["error"]["code"] == "engine_not_ready", body
    assert "none of the 2 replicas is up" in body["error"]["message"]


def test_get_load_of_the_engine(serve, gw_engine, monkeypatch):
    h = serve(False)
    status, idle = http(h.url + "/get_load")
    assert status == 200 and len(idle) == 1
    assert idle[0] | {"ts_tic": 0} == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0,
                                       "num_pending_tokens": 0, "ts_tic": 0}
    slow_steps(gw_engine, monkeypatch, 0.02)
    s = stream(h.url, n=2)
    _, [busy] = http(h.url + "/get_load")
    stats = gw_engine.get_stats()
    assert busy["num_reqs"] == 2 and busy["num_pending_tokens"] <= busy["num_tokens"]
    # The KV both choices hold: at least their prompts, at most what the engine holds a step later.
    assert 0 < busy["num_tokens"] <= stats.num_used_tokens + stats.waiting_tokens
    assert sum(1 for _ in s) > 0


def test_real_app_routes(gw_engine, gw_url):
    """The gateway serves both (app.py registers them): /load at 0 (GATEWAY_ARGS tracks nothing), /get_load
    the engine's one replica; while the engine loads, /load still answers and /get_load is a 503."""
    assert server_load(gw_url) == 0
    status, body = http(gw_url + "/get_load")
    assert status == 200 and [e["dp_rank"] for e in body] == [0]
    with serve_in_thread(lambda: None, GATEWAY_ARGS, port=0) as loading:
        assert server_load(loading.url) == 0
        status, body = http(loading.url + "/get_load")
        assert status == 503 and body["error"]["code"] == "engine_not_ready", body
