"""GET /dashboard (the live status page, dashboard_page.PAGE) and GET /dashboard/data (its numbers as
JSON, Dashboard.data), which the page fetches every second."""

from __future__ import annotations

from aiohttp import web

from runtime.gateway.dashboard_page import PAGE
from runtime.gateway.protocol import encode
from runtime.gateway.state import STATE_KEY

_NO_STORE = {"Cache-Control": "no-store"}


async def page(request: web.Request) -> web.Response:
    return web.Response(text=PAGE, content_type="text/html", headers=_NO_STORE)


async def data(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    client = state.current_client()
    model = state.served_model(client) if client is not None else state.args.served_model_name
    body = await state.dashboard.data(client, model)
    return web.Response(body=encode(body), content_type="application/json", headers=_NO_STORE)
