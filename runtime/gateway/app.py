"""build_app: the gateway's aiohttp Application — the route table and its middlewares: the access log
(access_log.py, outermost), then one that answers CORS preflights (cors.py), checks the API key
(api_keys.py) and turns every failure into an OpenAI-style error body (never a bare 500 page).

X-Request-Id, as vLLM's: a request that sends it is named by it (GatewayState.new_id: chatcmpl-<id>, ...),
and every response, streams and errors included, carries the header (vLLM does with
--enable-request-id-headers; here always, as it costs nothing): the client's own, or where it sent none the
id its response was named by (chatcmpl-<hex> answers <hex>), else a random one (request_ids.response_header).
The access log names each request by that header (_request_id).

A 404 of a path with no route (a browser's /favicon.ico, a probe of /docs) is answered as any error but kept
out of the dashboard's recent errors and errors_total: not a fault of a request the server serves. GET /
(dashboard_routes.root) points at the dashboard and the main routes; neither vLLM nor SGLang serve it."""

from __future__ import annotations

import asyncio
import functools
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
    health_routes,
    load_routes,
    lora_routes,
    native_routes,
    pause_routes,
    score_routes,
    tokenize_routes,
)
from runtime.gateway.access_log import AccessLog
from runtime.gateway.api_keys import ApiKeys
from runtime.gateway.body import payload_error
from runtime.gateway.cors import Cors
from runtime.gateway.errors import ApiError, from_http_exception, from_shoal_error
from runtime.gateway.health_probe import HEALTH_PROBE_KEY, HealthProbe
from runtime.gateway.openai_chat import chat_completions
from runtime.gateway.openai_completions import completions
from runtime.gateway.openai_embeddings import embeddings, health_embed, pooling
from runtime.gateway.openai_responses import responses
from runtime.gateway.request_ids import IdScope, current_scope, response_header, well_formed_id
from runtime.gateway.state import STATE_KEY, ClientProvider, GatewayState
from runtime.text.embedding_request import task_mismatch

logger = logging.getLogger("shoal.gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_REQUEST_ID = "X-Request-Id"
_ID_SCOPE = web.RequestKey("shoal_id_scope", IdScope)  # the handler's ids, for the header as the answer goes out
_ANSWERED_ID = web.RequestKey("shoal_answered_id", str)  # the X-Request-Id the answer went out with


def _middleware(api_keys: ApiKeys, cors: Cors) -> Callable:
    @web.middleware
    async def gateway_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        headers, no_route = None, False
        try:
            if cors.enabled and cors.is_preflight(request):
                return cors.preflight(request)
            if not api_keys.authorized(request):
                raise ApiError(401, "This route needs the admin key (--admin-api-key): send 'Authorization: "
                                    "Bearer <admin key>'." if api_keys.needs_admin_key(request) else
                               "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
            with request.app[STATE_KEY].request_scope(request.headers.get(_REQUEST_ID)):
                if (scope := current_scope()) is not None:
                    request[_ID_SCOPE] = scope
                return await handler(request)
        except ApiError as e:
            err = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            no_route = _no_route(request, e)
            err, headers = from_http_exception(e, request.path)
        except ShoalError as e:
            err = from_shoal_error(e)
        except web.RequestPayloadError as e:  # a route that reads the body itself (body.py maps it for the rest)
            err = payload_error(request, e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the last resort: a bug of ours must not take the server down
            logger.exception("unhandled error on %s %s", request.method, request.path)
            err = ApiError(500, f"internal error: {type(e).__name__}: {e}")
        if not no_route:
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


def _no_route(request: web.Request, e: web.HTTPException) -> bool:
    """A 404 of the router's: no route has this path (a route's own 404, an unknown model, is an error)."""
    # The router's own exception object, raised by its stand-in handler: request.match_info alone would not
    # do, as it stays the router's 404 where --root-path's middleware re-routed the request to a real route
    # (http_site._under_prefix) and that route answered 404 itself.
    return e.status == 404 and e is request.match_info.http_exception


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    # As the headers go out: a stream's leave before its handler returns, once its id is made.
    if _REQUEST_ID not in response.headers:
        response.headers[_REQUEST_ID] = response_header(request.headers.get(_REQUEST_ID), request.get(_ID_SCOPE))
    request[_ANSWERED_ID] = response.headers[_REQUEST_ID]


def _request_id(request: web.Request) -> str | None:
    """The access log's id of a request: the X-Request-Id its answer carried; where none went out (the client
    left first, a redirect still to be written) the one it would carry, short of a random one (None)."""
    if (answered := request.get(_ANSWERED_ID)) is not None:
        return answered
    sent = request.headers.get(_REQUEST_ID)
    if sent and well_formed_id(sent):
        return sent
    scope = request.get(_ID_SCOPE)
    return scope.base if scope is not None else None


async def _stop_background_tasks(app: web.Application) -> None:
    app[STATE_KEY].admission.loop_lag.stop()
    await app[HEALTH_PROBE_KEY].close()


def build_app(client_provider: EngineClient | ClientProvider, args: ServerArgs) -> web.Application:
    """client_provider: a ready EngineClient, or a zero-arg callable returning it (None while the
    model loads: model routes and /health answer 503 until then)."""
    cors, api_keys = Cors.from_args(args), ApiKeys(args.api_key, args.admin_api_key)
    middlewares = [AccessLog(args, _request_id).middleware(), _middleware(api_keys, cors)]
    app = web.Application(client_max_size=args.max_request_bytes, middlewares=middlewares)
    app[STATE_KEY] = GatewayState(client_provider, args)
    app[HEALTH_PROBE_KEY] = HealthProbe()  # /health_generate's check, shared by its callers
    _log_settings(args, api_keys)
    app.on_cleanup.append(_stop_background_tasks)
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
    app.router.add_get("/health", health_routes.health)
    app.router.add_get("/health_generate", _generation(health_routes.health_generate, health_embed))
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
    app.router.add_get("/", dashboard_routes.root)
    app.router.add_get("/favicon.ico", dashboard_routes.favicon)  # a browser's, on opening /dashboard
    app.router.add_get("/dashboard", dashboard_routes.page)
    app.router.add_get("/dashboard/data", dashboard_routes.data)
    app.router.add_get("/debug/ttft_trace", debug_routes.ttft_trace)
    app.router.add_post("/debug/ttft_trace", debug_routes.ttft_trace)
    pause_routes.add_routes(app)  # SGLang's /pause_generation, /continue_generation
    load_routes.add_routes(app)  # vLLM's /load, SGLang's /get_load
    admin_routes.add_routes(app)  # /flush_cache, /reset_prefix_cache, server info, /ping, /invocations, profiling
    return app


def _log_settings(args: ServerArgs, api_keys: ApiKeys) -> None:
    """The gateway's access settings, once at start (never a key itself)."""
    if keys := len(api_keys):
        logger.info("API key required (%d key%s set): send 'Authorization: Bearer <key>' on every route but "
                    "/health*, /metrics, /ping, /version and /dashboard", keys, "s" if keys > 1 else "")
    if api_keys.has_admin_key:
        logger.info("admin key set (--admin-api-key): the operator routes (weights, pause, sleep, LoRA loading, "
                    "cache flush, profiling, /abort_request) take it and no other key")
    if args.enable_log_requests:
        cut = "in full" if args.max_log_len is None else f"up to {args.max_log_len} characters"
        logger.info("logging each request's sampling params at INFO and its prompt (%s) at DEBUG, on logger "
                    "shoal.requests (--enable-log-requests)", cut)
    elif args.max_log_len is not None:
        logger.warning("--max-log-len %d has no effect without --enable-log-requests", args.max_log_len)


def gateway_state(app: web.Application) -> GatewayState:
    return app[STATE_KEY]
