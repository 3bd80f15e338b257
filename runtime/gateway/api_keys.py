"""ApiKeys: --api-key's and --admin-api-key's check of each request (vLLM's several keys: any one authorizes).

Open without a key, as SGLang leaves them: every path starting with /health (/health, /health_generate:
probes), /metrics (scrapers), /ping (SageMaker's /health), /version, and the dashboard's page (it holds no
data; its script sends the key it finds in the page's #key=... fragment to /dashboard/data, which needs it
like any route). Every OPTIONS request passes too, as vLLM's and SGLang's: a browser's preflight never
carries Authorization, and CORS (or the router's 405) answers it. Paths are matched as the route that
answers them: without --root-path's prefix where it is re-routed (/prefix is /), as vLLM's check strips it.

The operator routes (ADMIN_PATHS: SGLang's ADMIN_OPTIONAL ones and vLLM's counterparts) follow SGLang's
--admin-api-key: with it set they take that key only (an --api-key key is refused there, and the other
routes still need an --api-key key when one is set); without it --api-key guards them like any route;
with neither they are open."""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web
from yarl import URL

from runtime.gateway.http_site import ROOT_PATH_KEY

_OPEN_PATHS = frozenset({"/", "/favicon.ico", "/ping", "/metrics", "/dashboard", "/version"})
_OPEN_PREFIX = "/health"
# What changes the server for everyone (weights, its process group's peer, memory, adapters, the cache, a
# pause, profiling to disk) or stops another client's request: an inference key must not reach these.
ADMIN_PATHS = frozenset({
    "/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
    "/destroy_weights_update_group", "/pause_generation", "/continue_generation", "/sleep", "/wake_up",
    "/release_memory_occupation", "/resume_memory_occupation", "/flush_cache", "/reset_prefix_cache",
    "/start_profile", "/stop_profile", "/load_lora_adapter", "/unload_lora_adapter", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter", "/abort_request", "/debug/ttft_trace",
})


def _digest(key: str) -> bytes:
    # surrogateescape: a header with bytes that are not UTF-8 is simply a wrong key (401), not a 500.
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _route_path(request: web.Request) -> str:
    """The path of the route that answers: under --root-path, where no route has the path as sent, the rest
    after the prefix (/prefix, /prefix/ and /prefix?q: /), as http_site._under_prefix re-routes it, from the
    raw path as that does (a %-encoded prefix is no prefix there, so none here)."""
    root = request.app.get(ROOT_PATH_KEY, "")
    if not root or request.match_info.http_exception is None:
        return request.path
    raw = request.raw_path
    if not raw.startswith(root) or raw[len(root):len(root) + 1] not in ("/", "?", ""):
        return request.path
    rest = raw[len(root):]
    return URL(rest if rest.startswith("/") else "/" + rest).path


class ApiKeys:
    def __init__(self, keys: tuple[str, ...] | None, admin_key: str | None = None):
        # Compared as digests of one length, every key each time: the time taken says nothing of which key
        # (or how much of one) matched.
        self._digests = tuple(_digest(k) for k in keys or ())
        self._admin = (_digest(admin_key),) if admin_key else ()

    def __len__(self) -> int:
        return len(self._digests)

    @property
    def has_admin_key(self) -> bool:
        return bool(self._admin)

    @staticmethod
    def is_open(request: web.Request) -> bool:
        if request.method == "OPTIONS":
            return True
        path = _route_path(request)
        return path in _OPEN_PATHS or path.startswith(_OPEN_PREFIX)

    def needs_admin_key(self, request: web.Request) -> bool:
        """Whether this request is refused unless it carries --admin-api-key."""
        return bool(self._admin) and not self.is_open(request) and _route_path(request) in ADMIN_PATHS

    def authorized(self, request: web.Request) -> bool:
        if self.needs_admin_key(request):
            return self._sent_one_of(request, self._admin)
        if not self._digests or self.is_open(request):
            return True
        return self._sent_one_of(request, self._digests)

    @staticmethod
    def _sent_one_of(request: web.Request, digests: tuple[bytes, ...]) -> bool:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        sent, found = _digest(token.strip()), False
        for digest in digests:
            found |= hmac.compare_digest(sent, digest)
        return found
