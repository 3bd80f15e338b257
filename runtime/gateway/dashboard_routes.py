"""GET /dashboard (the live status page, dashboard_page.PAGE) and GET /dashboard/data (its numbers as
JSON, Dashboard.data), which the page fetches every second; and what a browser or a first look asks the
server's root for: GET / (a browser to the dashboard, any other client a short list of the main routes;
vLLM and SGLang answer it 404) and GET /favicon.ico (a small icon, the dashboard's too), so neither is an
unknown route."""

from __future__ import annotations

from types import MappingProxyType

from aiohttp import web

from runtime.gateway.dashboard_page import ICON, PAGE
from runtime.gateway.http_site import ROOT_PATH_KEY
from runtime.gateway.protocol import encode
from runtime.gateway.state import STATE_KEY

_NO_STORE = {"Cache-Control": "no-store"}
# What GET / lists: the routes a first client wants, not every one (the README lists those).
ROUTES = MappingProxyType({
    "openai": ("/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"),
    "native": ("/generate", "/encode", "/tokenize", "/detokenize"),
    "operations": ("/health", "/health_generate", "/metrics", "/version", "/dashboard"),
})


async def root(request: web.Request) -> web.Response:
    # Under --root-path every path a client is given carries the prefix: it reaches the route whether the
    # proxy strips the prefix or keeps it (http_site re-routes), and a browser at /prefix (no trailing slash)
    # would take a relative "dashboard" to /dashboard, outside it. Without one, relative as before: right at /
    # and behind a proxy that strips a prefix the server was not told of.
    root_path = request.app.get(ROOT_PATH_KEY, "")
    if "text/html" in request.headers.get("Accept", ""):
        return web.Response(status=302, headers={"Location": f"{root_path}/dashboard" if root_path else "dashboard"})
    body = {"object": "shoal.server", "dashboard": f"{root_path}/dashboard",
            "routes": {k: [root_path + p for p in v] for k, v in ROUTES.items()}}
    return web.Response(body=encode(body), content_type="application/json")


async def favicon(request: web.Request) -> web.Response:
    return web.Response(body=ICON.encode(), content_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})


async def page(request: web.Request) -> web.Response:
    return web.Response(text=PAGE, content_type="text/html", headers=_NO_STORE)


async def data(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    client = state.current_client()
    model = state.served_model(client) if client is not None else state.args.served_model_name
    body = await state.dashboard.data(client, model)
    return web.Response(body=encode(body), content_type="application/json", headers=_NO_STORE)
