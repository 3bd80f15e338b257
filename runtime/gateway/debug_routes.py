"""GET /debug/ttft_trace: the medians of the gateway's first-token hops over the last requests
(TtftTrace); POST {"reset": true} forgets them first (a benchmark's warm-up stays out of its numbers)."""

from __future__ import annotations

import json

from aiohttp import web

from runtime.gateway.state import STATE_KEY


async def ttft_trace(request: web.Request) -> web.Response:
    trace = request.app[STATE_KEY].ttft_trace
    if request.method == "POST":
        body = await request.json() if request.can_read_body else {}
        if isinstance(body, dict) and body.get("reset"):
            trace.reset()
    return web.Response(text=json.dumps(trace.summary()), content_type="application/json")
