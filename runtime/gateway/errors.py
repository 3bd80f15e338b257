"""OpenAI-style error bodies ({"error": {message, type, param, code}}) and the mapping of every failure
the gateway can meet — our typed errors, msgspec decode errors, aiohttp's own 404/405/413 — onto them."""

from __future__ import annotations

import math

import msgspec
from aiohttp import web

from runtime.engine_client import EngineUnhealthyError
from runtime.errors import (
    ContextLengthError,
    EngineUnavailableError,
    InvalidRequestError,
    RequestAbortedError,
    ShoalError,
)
from runtime.gateway.protocol import ErrorInfo, ErrorResponse, encode

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error", 500: "internal_server_error"}
_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
          429: "too_many_requests", 503: "service_unavailable", 500: "internal_error"}
# Retry-After (whole seconds) of a 503 engine_not_ready: the model still loading, or a drain handing over to
# another replica. Neither vLLM (no HTTP server until its engine is up) nor SGLang sends one; a loading
# server cannot say when it is done, and a refusal costs next to nothing, so clients look again each second
# (OpenAI's SDK sleeps what this says rather than its own backoff).
NOT_READY_RETRY_S = 1


class ApiError(Exception):
    """An HTTP error answer, raised anywhere in a handler and turned into a response by the middleware."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _CODES.get(status)
        if headers is None and status == 503 and self.code == "engine_not_ready":
            headers = {"Retry-After": str(NOT_READY_RETRY_S)}
        self.headers = headers
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code))

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(status=self.status, body=encode(self.body()), content_type="application/json",
                            headers=headers if headers is not None else self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_supported(feature: str, param: str) -> ApiError:
    return ApiError(400, f"{feature} is not supported by this server yet", param=param, code="unsupported")


def from_shoal_error(e: ShoalError) -> ApiError:
    if isinstance(e, ContextLengthError):
        return ApiError(400, e.message, param=e.param, code=e.code)
    if isinstance(e, InvalidRequestError):
        code = None if e.code == "invalid_request_error" else e.code
        return ApiError(400, e.message, param=e.param, code=code or "invalid_value")
    if isinstance(e, EngineUnhealthyError):  # its message names the reason already
        return ApiError(503, str(e), code="engine_unhealthy")
    retry_after = getattr(e, "retry_after_s", None)  # GrammarBusyError: the compile pool, not the request
    if isinstance(e, EngineUnavailableError) and retry_after:
        return ApiError(503, str(e), code="grammar_compiler_busy",
                        headers={"Retry-After": str(max(1, math.ceil(retry_after)))})
    if isinstance(e, EngineUnavailableError):
        return ApiError(503, f"the engine is unavailable: {e}")
    if isinstance(e, RequestAbortedError):
        return ApiError(503, f"the request was aborted: {e}", code="aborted")
    return ApiError(500, f"{type(e).__name__}: {e}")


def from_decode_error(e: msgspec.DecodeError) -> ApiError:
    """msgspec says what and where, e.g. "Expected `int`, got `str` - at `$.max_tokens`"."""
    msg = str(e)
    if not isinstance(e, msgspec.ValidationError):
        return ApiError(400, f"the request body is not valid JSON: {msg}", code="invalid_json")
    param = None
    if "at `$." in msg:
        param = msg.split("at `$.", 1)[1].split("`")[0].split("[")[0].split(".")[0] or None
    if "out of range" in msg or "` <= " in msg or "` >= " in msg:
        return ApiError(400, f"{param or 'a number'} is out of range: {msg}", param=param, code="invalid_value")
    return ApiError(400, f"invalid request: {msg}", param=param, code="invalid_type")


def from_http_exception(e: web.HTTPException, path: str) -> tuple[ApiError, dict[str, str]]:
    """aiohttp's router and body reader raise these; answer them with our error body."""
    if e.status == 404:
        err = ApiError(404, f"no route {path}", code="not_found")
    elif e.status == 405:
        err = ApiError(405, f"method not allowed on {path}; allowed: {e.headers.get('Allow', '?')}")
    elif e.status == 413:
        err = ApiError(413, f"the request body is too large: {e.text or e.reason}")
    else:
        err = ApiError(e.status, e.text or e.reason)
    headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
    return err, headers
