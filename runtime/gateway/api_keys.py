"""ApiKeys: --api-key's check of each request (vLLM's several keys: any one authorizes).

Open without a key, as SGLang leaves them: every path starting with /health (/health, /health_generate:
probes), /metrics (scrapers), /ping (SageMaker's /health), /version, and the dashboard's page (it holds no
data; its script sends the key it finds in the page's #key=... fragment to /dashboard/data, which needs it
like any route). Every OPTIONS request passes too, as vLLM's and SGLang's: a browser's preflight never
carries Authorization, and CORS (or the router's 405) answers it. Paths are matched without --root-path's
prefix, as vLLM's check strips it."""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from runtime.gateway.http_site import ROOT_PATH_KEY

_OPEN_PATHS = frozenset({"/ping", "/metrics", "/dashboard", "/version"})
_OPEN_PREFIX = "/health"


def _digest(key: str) -> bytes:
    # surrogateescape: a header with bytes that are not UTF-8 is simply a wrong key (401), not a 500.
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class ApiKeys:
    def __init__(self, keys: tuple[str, ...] | None):
        # Compared as digests of one length, every key each time: the time taken says nothing of which key
        # (or how much of one) matched.
        self._digests = tuple(_digest(k) for k in keys or ())

    def __len__(self) -> int:
        return len(self._digests)

    @staticmethod
    def is_open(request: web.Request) -> bool:
        if request.method == "OPTIONS":
            return True
        root, path = request.app.get(ROOT_PATH_KEY, ""), request.path
        path = path[len(root):] if root and path.startswith(root + "/") else path
        return path in _OPEN_PATHS or path.startswith(_OPEN_PREFIX)

    def authorized(self, request: web.Request) -> bool:
        if not self._digests or self.is_open(request):
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        sent, found = _digest(token.strip()), False
        for digest in self._digests:
            found |= hmac.compare_digest(sent, digest)
        return found
