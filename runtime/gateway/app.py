"""build_app: the gateway's aiohttp Application — the route table, CORS (--allowed-origins) and the one
middleware that checks the API key and turns every failure into an OpenAI-style error body (never a bare
500 page).

CORS, as vLLM's --allowed-origins and SGLang do it, so a browser page can call the API: a preflight
(OPTIONS with Access-Control-Request-Method) from an allowed origin is answered 204 on any path, before
the API key is checked (a browser never sends Authorization on a preflight); every response to a
request from an allowed origin — errors and SSE streams included — carries Access-Control-Allow-Origin,
added as its headers go out (on_response_prepare: a stream's headers leave before its handler returns).
A disallowed origin gets no CORS headers, so the browser blocks the page from reading the answer.

X-Request-Id, as vLLM's: a request that sends it is named by it (GatewayState.new_id: chatcmpl-<id>, ...),
and every response to it, streams and errors included, carries the header back (vLLM echoes it with
--enable-request-id-headers; here always, as it costs nothing)."""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from runtime.config import ServerArgs
from runtime.engine_client import EngineClient
from runtime.errors import ShoalError
from runtime.gateway import (
    admin_routes,
    classify_routes,
    dashboard_routes,
    debug_routes,
    lora_routes,
    native_routes,
    pause_routes,
    score_routes,
    tokenize_routes,
)
from runtime.gateway.errors import ApiError, from_http_exception, from_shoal_error
from runtime.gateway.http_site import ROOT_PATH_KEY
from runtime.gateway.openai_chat import chat_completions
from runtime.gateway.openai_completions import completions
from runtime.gateway.openai_embeddings import embeddings, health_embed, pooling
from runtime.gateway.openai_responses import responses
from runtime.gateway.state import STATE_KEY, ClientProvider, GatewayState
from runtime.text.embedding_request import task_mismatch

logger = logging.getLogger("shoal.gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# No API key needed: probes, scrapers, and the dashboard's page (it holds no data; its script sends the
# key it finds in the page's #key=... fragment to /dashboard/data, which needs it like any route).
_OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/dashboard", "/version"})  # /ping: SageMaker's /health
_REQUEST_ID = "X-Request-Id"


def _authorized(request: web.Request, api_key: str) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    # surrogateescape: a header with bytes that are not UTF-8 is simply a wrong key (401), not a 500.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"),
                                                               api_key.encode())


class Cors:
    """--allowed-origins: comma-separated origins, '*' any, '' none (CORS off)."""

    METHODS = "GET, POST, OPTIONS"
    BASE_HEADERS = ("Authorization", "Content-Type")
    # Not CORS-safelisted, so a page cannot read them unless told: a 429's pacing, OpenAI-style.
    EXPOSE = "Retry-After, retry-after-ms, X-Request-Id"
    MAX_AGE_S = 600

    def __init__(self, allowed_origins: str):
        origins = {o.strip().rstrip("/").lower() for o in allowed_origins.split(",")} - {""}
        self.any = "*" in origins
        self.origins = frozenset(origins - {"*"})
        self.enabled = self.any or bool(self.origins)

    def allows(self, origin: str | None) -> bool:
        # Browsers serialize an origin as lower-case scheme://host[:port]; the flag may be written loosely.
        return bool(origin) and self.enabled and (self.any or origin.rstrip("/").lower() in self.origins)

    def _origin_headers(self, origin: str) -> dict[str, str]:
        # '*' needs no Vary; an echoed origin does, or a shared cache would serve one origin's answer to another.
        return {"Access-Control-Allow-Origin": "*"} if self.any else {
            "Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    @staticmethod
    def is_preflight(request: web.Request) -> bool:
        return (request.method == "OPTIONS" and "Origin" in request.headers
                and "Access-Control-Request-Method" in request.headers)

    def preflight(self, request: web.Request) -> web.Response:
        origin = request.headers["Origin"]
        if not self.allows(origin):
            raise ApiError(403, f"origin {origin!r} may not call this server (see --allowed-origins)",
                           code="cors_origin_not_allowed")
        asked = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",")]
        allow = list(self.BASE_HEADERS)
        allow += [h for h in asked if h and h.lower() not in {a.lower() for a in allow}]
        headers = self._origin_headers(origin)
        headers.update({"Access-Control-Allow-Methods": self.METHODS,
                        "Access-Control-Allow-Headers": ", ".join(allow),
                        "Access-Control-Max-Age": str(self.MAX_AGE_S)})
        return web.Response(status=204, headers=headers)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if not self.allows(origin) or "Access-Control-Allow-Origin" in response.headers:
            return
        for k, v in self._origin_headers(origin).items():
            if k == "Vary" and "Vary" in response.headers:
                response.headers["Vary"] = f"{response.headers['Vary']}, {v}"
            else:
                response.headers[k] = v
        response.headers["Access-Control-Expose-Headers"] = self.EXPOSE


def _unprefixed(request: web.Request) -> str:
    """The request's path without --root-path's prefix (vLLM's auth strips it too before its open paths)."""
    root, path = request.app.get(ROOT_PATH_KEY, ""), request.path
    return path[len(root):] if root and path.startswith(root + "/") else path


def _middleware(api_key: str | None, cors: Cors) -> Callable:
    @web.middleware
    async def gateway_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        headers = None
        try:
            if cors.enabled and cors.is_preflight(request):
                return cors.preflight(request)
            if api_key and _unprefixed(request) not in _OPEN_PATHS and not _authorized(request, api_key):
                raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
            with request.app[STATE_KEY].request_scope(request.headers.get(_REQUEST_ID)):
                return await handler(request)
        except ApiError as e:
            err = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err, headers = from_http_exception(e, request.path)
        except ShoalError as e:
            err = from_shoal_error(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the last resort: a bug of ours must not take the server down
            logger.exception("unhandled error on %s %s", request.method, request.path)
            err = ApiError(500, f"internal error: {type(e).__name__}: {e}")
        request.app[STATE_KEY].errors.record(request.method, request.path, err)
        return err.response(headers)

    return gateway_middleware


def _generation(handler: Handler, on_embedding: Handler | None = None) -> Handler:
    """A generation route: on an embedding server (its client has a pooling) a 400 naming the mismatch, as
    vLLM's, or `on_embedding` where that server has its own form of the route."""

    @functools.wraps(handler)
    async def route(request: web.Request) -> web.StreamResponse:
        client = request.app[STATE_KEY].current_client()
        if client is not None and client.pooling is not None:
            if on_embedding is not None:
                return await on_embedding(request)
            raise ApiError(400, task_mismatch(True), param="model", code="model_not_supported")
        return await handler(request)

    return route


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    # As the headers go out: a stream's leave before its handler returns. Only what a header can carry as sent.
    value = request.headers.get(_REQUEST_ID)
    if value is not None and value.isascii() and value.isprintable() and _REQUEST_ID not in response.headers:
        response.headers[_REQUEST_ID] = value


async def _stop_samplers(app: web.Application) -> None:
    app[STATE_KEY].admission.loop_lag.stop()


def build_app(client_provider: EngineClient | ClientProvider, args: ServerArgs) -> web.Application:
    """client_provider: a ready EngineClient, or a zero-arg callable returning it (None while the
    model loads: model routes and /health answer 503 until then)."""
    cors = Cors(args.allowed_origins)
    app = web.Application(client_max_size=args.max_request_bytes, middlewares=[_middleware(args.api_key, cors)])
    app[STATE_KEY] = GatewayState(client_provider, args)
    app.on_cleanup.append(_stop_samplers)
    app.on_response_prepare.append(_echo_request_id)
    if cors.enabled:
        app.on_response_prepare.append(cors.on_prepare)
    app.router.add_post("/v1/completions", _generation(completions))
    app.router.add_post("/v1/chat/completions", _generation(chat_completions))
    app.router.add_post("/v1/responses", _generation(responses))
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/pooling", pooling)  # vLLM's: the pooled output, in its own shape
    app.router.add_post("/classify", classify_routes.classify)  # vLLM's (SGLang's body too)
    app.router.add_post("/v1/classify", classify_routes.classify)  # SGLang's path for vLLM's form
    for path in ("/score", "/v1/score"):  # vLLM's
        app.router.add_post(path, score_routes.score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):  # vLLM's Jina / Cohere form (SGLang's /v1/rerank too)
        app.router.add_post(path, score_routes.rerank)
    app.router.add_get("/v1/models", native_routes.models)
    app.router.add_get("/v1/models/{model:.+}", native_routes.model)  # a model name may hold '/'
    app.router.add_post("/generate", _generation(native_routes.generate))
    app.router.add_post("/encode", native_routes.encode_request)
    app.router.add_post("/abort_request", native_routes.abort_request)
    app.router.add_get("/health", native_routes.health)
    app.router.add_get("/health_generate", _generation(native_routes.health_generate, health_embed))
    app.router.add_get("/version", native_routes.version)
    app.router.add_get("/metrics", native_routes.metrics)
    app.router.add_post("/v1/load_lora_adapter", lora_routes.vllm_load)  # LoRA adapters at run time
    app.router.add_post("/v1/unload_lora_adapter", lora_routes.vllm_unload)
    app.router.add_post("/load_lora_adapter", lora_routes.sglang_load)
    app.router.add_post("/unload_lora_adapter", lora_routes.sglang_unload)
    for path in ("/tokenize", "/v1/tokenize"):  # vLLM's path; SGLang serves both
        app.router.add_post(path, tokenize_routes.tokenize)
    for path in ("/detokenize", "/v1/detokenize"):
        app.router.add_post(path, tokenize_routes.detokenize)
    app.router.add_get("/dashboard", dashboard_routes.page)
    app.router.add_get("/dashboard/data", dashboard_routes.data)
    app.router.add_get("/debug/ttft_trace", debug_routes.ttft_trace)
    app.router.add_post("/debug/ttft_trace", debug_routes.ttft_trace)
    pause_routes.add_routes(app)  # SGLang's /pause_generation, /continue_generation
    admin_routes.add_routes(app)  # /flush_cache, /reset_prefix_cache, server info, /ping, /invocations, profiling
    return app


def gateway_state(app: web.Application) -> GatewayState:
    return app[STATE_KEY]
