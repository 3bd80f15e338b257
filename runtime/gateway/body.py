"""Reading a request body into its protocol Struct: size limit (413, enforced by aiohttp's
client_max_size), a body that cannot be read as sent (a Content-Encoding it does not decode as, a broken
chunked framing: 400 naming it), JSON syntax, types and integer ranges (400), all as OpenAI-style errors;
keys the Struct does not declare are accepted, logged and counted (IgnoredFields)."""

from __future__ import annotations

from typing import TypeVar

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from runtime.gateway.errors import ApiError, bad_request, from_decode_error
from runtime.gateway.state import STATE_KEY

T = TypeVar("T")
# On a request: its body's bytes once read (decoded: a 10 KB gzip body may hold 8 MB of prompt). An aiohttp
# RequestKey: made once, holds nothing.
BODY_BYTES_KEY = web.RequestKey("shoal_body_bytes", int)


def payload_error(request: web.Request, e: web.RequestPayloadError) -> ApiError:
    """aiohttp's failure to read the body (the middleware maps it too, for routes that read it themselves)."""
    encoding = request.headers.get("Content-Encoding", "").strip()
    if isinstance(e.__cause__, ContentEncodingError) or (encoding and "content-encoding" in str(e).lower()):
        return bad_request(f"the request body is not valid {encoding!r} data (Content-Encoding: {encoding}); send it "
                           "encoded as the header says, or uncompressed without the header",
                           param="Content-Encoding", code="invalid_body")
    return bad_request(f"the request body could not be read: {str(e).splitlines()[-1].strip()}", code="invalid_body")


async def read_raw(request: web.Request) -> bytes:
    """The body as the handler reads it (decompressed by aiohttp per Content-Encoding); its length is noted
    on the request (BODY_BYTES_KEY): what the route will encode, where Content-Length gives the wire size."""
    try:
        raw = await request.read()  # raises HTTPRequestEntityTooLarge past client_max_size
    except web.RequestPayloadError as e:
        raise payload_error(request, e) from None
    request[BODY_BYTES_KEY] = len(raw)
    return raw


async def read_body(request: web.Request, kind: type[T]) -> T:
    raw = await read_raw(request)
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
    raw = await read_raw(request)
    if not raw.strip():
        return kind()
    try:
        body = msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as e:
        raise bad_request(f"invalid {what} request: {e}", param=param) from None
    request.app[STATE_KEY].ignored_fields.note(raw, kind, request.path)
    return body
