"""Cors: the gateway's CORS, as vLLM's flags (--allowed-origins, --allowed-methods, --allowed-headers,
--allow-credentials) ask Starlette's CORSMiddleware for it, so a browser page can call the API.

A preflight (OPTIONS with Origin and Access-Control-Request-Method) is answered 204 on any path, before the
API key is checked (a browser never sends Authorization on one), or 403 naming what is not allowed: the
origin, the method or a header. Every response to a request from an allowed origin (errors and SSE streams
included) carries Access-Control-Allow-Origin, added as its headers go out (on_prepare: a stream's headers
leave before its handler returns). A disallowed origin gets no CORS headers, so the browser keeps the answer
from the page. With --allow-credentials the page's own origin is echoed, never '*' (browsers refuse '*'
with credentials), and only for origins listed by name: check_credentials refuses it beside '*' or "null"."""

from __future__ import annotations

from aiohttp import web

from runtime.config import ServerArgs
from runtime.gateway.errors import ApiError
from runtime.http_flags import check_credentials, cors_headers, cors_methods, cors_origins

ANY_METHOD = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")  # what '*' allows (Starlette's)
# A page may always send these (the Fetch standard's CORS-safelisted request headers).
SAFELISTED = frozenset({"accept", "accept-language", "content-language", "content-type"})


class Cors:
    # Not CORS-safelisted, so a page cannot read them unless told: a 429's pacing, OpenAI-style.
    EXPOSE = "Retry-After, retry-after-ms, X-Request-Id"
    BASE_HEADERS = ("Authorization", "Content-Type")  # with '*' headers: always allowed, beside those asked
    MAX_AGE_S = 600

    def __init__(self, origins: tuple[str, ...], methods: tuple[str, ...] = ("*",),
                 headers: tuple[str, ...] = ("*",), credentials: bool = False):
        """origins: as http_flags.cors_origins gives them (('*',) any, () CORS off); methods and headers:
        cors_methods / cors_headers' ('*',) any; credentials with '*' or "null": check_credentials refuses."""
        check_credentials(origins, credentials)
        self.any = "*" in origins
        self.origins = frozenset(origins) - {"*"}
        self.enabled = self.any or bool(self.origins)
        self.methods = ANY_METHOD if "*" in methods else methods
        self.any_header = "*" in headers
        self.headers = SAFELISTED | set(headers)
        self.credentials = credentials

    @classmethod
    def from_args(cls, args: ServerArgs) -> Cors:
        return cls(cors_origins(args.allowed_origins), cors_methods(args.allowed_methods),
                   cors_headers(args.allowed_headers), args.allow_credentials)

    def allows(self, origin: str | None) -> bool:
        # Browsers serialize an origin as lower-case scheme://host[:port]; the flag may be written loosely.
        return bool(origin) and self.enabled and (self.any or origin.rstrip("/").lower() in self.origins)

    def _origin_headers(self, origin: str) -> dict[str, str]:
        # '*' needs no Vary; an echoed origin does, or a shared cache would serve one origin's answer to another.
        if self.any:  # never with credentials (check_credentials)
            return {"Access-Control-Allow-Origin": "*"}
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    @staticmethod
    def is_preflight(request: web.Request) -> bool:
        return (request.method == "OPTIONS" and "Origin" in request.headers
                and "Access-Control-Request-Method" in request.headers)

    def preflight(self, request: web.Request) -> web.Response:
        origin = request.headers["Origin"]
        if not self.allows(origin):
            raise ApiError(403, f"origin {origin!r} may not call this server (see --allowed-origins)",
                           code="cors_origin_not_allowed")
        method = request.headers["Access-Control-Request-Method"].strip().upper()
        if method not in self.methods:
            raise ApiError(403, f"method {method} may not be asked by a preflight (see --allowed-methods: "
                                f"{', '.join(self.methods)})", code="cors_method_not_allowed")
        asked = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",")]
        asked = [h for h in asked if h]
        if self.any_header:
            allow = list(self.BASE_HEADERS)
            allow += [h for h in asked if h.lower() not in {a.lower() for a in allow}]
        else:
            refused = [h for h in asked if h.lower() not in self.headers]
            if refused:
                raise ApiError(403, f"request header {refused[0]!r} may not be sent from a page (see "
                                    "--allowed-headers)", code="cors_headers_not_allowed")
            allow = sorted(self.headers)
        headers = self._origin_headers(origin)
        headers.update({"Access-Control-Allow-Methods": ", ".join(self.methods),
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
