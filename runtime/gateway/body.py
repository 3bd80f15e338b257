"""Reading a request body into its protocol Struct: size limit (413, enforced by aiohttp's
client_max_size), JSON syntax, types and integer ranges (400), all as OpenAI-style errors; keys the
Struct does not declare are accepted, logged and counted (IgnoredFields)."""

from __future__ import annotations

from typing import TypeVar

import msgspec
from aiohttp import web

from runtime.gateway.errors import ApiError, bad_request, from_decode_error
from runtime.gateway.state import STATE_KEY

T = TypeVar("T")


async def read_body(request: web.Request, kind: type[T]) -> T:
    raw = await request.read()  # raises HTTPRequestEntityTooLarge past client_max_size
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None
    except (UnicodeDecodeError, RecursionError) as e:  # not UTF-8, or nested past any sane depth
        raise ApiError(400, f"the request body is not valid JSON: {type(e).__name__}", code="invalid_json") from None
    request.app[STATE_KEY].ignored_fields.note(raw, kind, request.path)
    return body


async def read_optional_body(request: web.Request, kind: type[T], what: str, param: str) -> T:
    """An operator route's body, which may be absent (kind's defaults then): a decode error is a 400 naming
    `param`, undeclared keys are noted as read_body notes them."""
    raw = await request.read()
    if not raw.strip():
        return kind()
    try:
        body = msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as e:
        raise bad_request(f"invalid {what} request: {e}", param=param) from None
    request.app[STATE_KEY].ignored_fields.note(raw, kind, request.path)
    return body
