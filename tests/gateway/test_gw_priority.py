"""`priority` on every generating route (chat, completions, responses, SGLang's /generate at the body's top
level): carried to the scheduler in the GenerateRequest where the engine schedules by priority; a 400 naming
it where it does not (a non-zero value), or when it is not an integer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gw_helpers import GATEWAY_ARGS, http

from runtime import Engine
from runtime.gateway.server import serve_in_thread

ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
}


@pytest.fixture(scope="module")
def prio_server(tiny_llama) -> Iterator[tuple[str, list[tuple[str, int]]]]:
    """A gateway over an engine with --enable-priority-scheduling, and the (rid, priority) of each request
    its scheduler was handed."""
    engine = Engine(str(tiny_llama), device="cpu", max_total_tokens=4096, log_level="warning",
                    enable_priority_scheduling=True)
    seen: list[tuple[str, int]] = []
    submit = engine.host.submit

    def recording(req: Any) -> None:
        seen.append((req.rid, req.priority))
        submit(req)

    engine.host.submit = recording
    try:
        with serve_in_thread(engine, GATEWAY_ARGS, port=0) as handle:
            yield handle.url, seen
    finally:
        engine.shutdown()


@pytest.mark.parametrize("route", list(ROUTES))
def test_routes_carry_priority_to_the_scheduler(prio_server, route):
    url, seen = prio_server
    for priority in (7, -2):
        seen.clear()
        status, body = http(url + route, "POST", {**ROUTES[route], "priority": priority})
        assert status == 200, body
        assert [p for _, p in seen] == [priority]
    seen.clear()
    status, _ = http(url + route, "POST", ROUTES[route])  # none given: 0
    assert status == 200 and [p for _, p in seen] == [0]


@pytest.mark.parametrize("route", list(ROUTES))
def test_priority_without_the_flag_or_not_an_integer_is_a_400(gw_url, route):
    status, body = http(gw_url + route, "POST", {**ROUTES[route], "priority": 3})
    assert status == 400 and body["error"]["param"] == "priority", body
    assert "--enable-priority-scheduling" in body["error"]["message"]
    for bad in ("high", 1.5, True, 2**70):
        status, body = http(gw_url + route, "POST", {**ROUTES[route], "priority": bad})
        assert status == 400 and body["error"]["param"] == "priority", (bad, body)
    status, body = http(gw_url + route, "POST", {**ROUTES[route], "priority": 0})  # the default is always fine
    assert status == 200, body
