"""HttpSite: how `shoal serve` listens beyond host and port, from vLLM's flags: TLS (--ssl-certfile,
--ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs, as uvicorn takes them) and --root-path (FastAPI's root_path:
the routes also answer under that prefix, for a proxy that forwards /prefix/v1/... unchanged; one that strips
the prefix reaches them at / as always).

On Ray the gateway actor gets the flags as a SiteSpec (paths, not an SSLContext) and opens the files again on
its node, the CLI's node (serve_gateway_actor pins it there); the CLI has loaded them first, so a bad file is
an error naming its flag before Ray starts."""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web as _web

from runtime.errors import ServerArgsError

# --root-path as the app keeps it: the API-key check opens /prefix/health as it opens /health (app.py)
ROOT_PATH_KEY = _web.AppKey("shoal_root_path", str)

if TYPE_CHECKING:  # aiohttp is imported where the site starts, not by the CLI's flag parsing
    from aiohttp import web
    from aiohttp.typedefs import Handler, Middleware

_FLAGS = ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "ssl_cert_reqs", "root_path")


class SiteSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The flags as given: what crosses to the Ray gateway actor, which builds its HttpSite from them on its
    own node (an ssl.SSLContext does not pickle). root_path is already checked ("" or "/prefix")."""

    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int | None = None  # uvicorn's ints: ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED
    root_path: str = ""


@dataclass(frozen=True, slots=True)
class HttpSite:
    spec: SiteSpec = SiteSpec()
    ssl_context: ssl.SSLContext | None = None  # built from spec (open_site)

    @property
    def root_path(self) -> str:
        return self.spec.root_path

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context is not None else "http"

    def install(self, app: web.Application) -> None:
        """Adds --root-path's routing to an app not yet started (its middlewares freeze then)."""
        if self.root_path:
            app[ROOT_PATH_KEY] = self.root_path
            app.middlewares.append(_under_prefix(self.root_path))


def add_site_flags(group: argparse._ArgumentGroup) -> None:
    """Registers the flags on `shoal serve`, hidden from --help (vllm_flags' group line names them)."""
    for name in _FLAGS[:3] + _FLAGS[4:]:
        group.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=argparse.SUPPRESS)
    group.add_argument("--ssl-cert-reqs", type=int, default=None, choices=(0, 1, 2), help=argparse.SUPPRESS)


def http_site(ns: argparse.Namespace) -> HttpSite:
    """The parsed flags, checked now: a certificate that does not load is an error naming its flag before
    the model starts loading (on Ray too: the gateway actor loads it again on its node)."""
    return open_site(site_spec(ns))


def site_spec(ns: argparse.Namespace) -> SiteSpec:
    """The parsed flags as a SiteSpec, their combination checked (no file is read)."""
    given = [n for n in _FLAGS if getattr(ns, n, None) is not None]
    if not given:
        return SiteSpec()
    if ns.ssl_certfile is None:
        stray = next((n for n in given if n.startswith("ssl_")), None)
        if stray is not None:
            raise ServerArgsError("--" + stray.replace("_", "-"), "needs --ssl-certfile (the server's certificate)")
    return SiteSpec(ssl_certfile=_absolute(ns.ssl_certfile), ssl_keyfile=_absolute(ns.ssl_keyfile),
                    ssl_ca_certs=_absolute(ns.ssl_ca_certs), ssl_cert_reqs=ns.ssl_cert_reqs, root_path=_root_path(ns.root_path))


def open_site(spec: SiteSpec, interactive: bool = True) -> HttpSite:
    """Loads spec's certificate, key and CA file from this machine; a file that does not load (or a
    --ssl-cert-reqs outside 0..2, or a spec built in Python with a bad root path) is a ServerArgsError naming
    its flag. interactive False (the Ray gateway actor, no terminal): an encrypted key is refused by name
    rather than prompting for its passphrase where nobody can answer."""
    if _root_path(spec.root_path or None) != spec.root_path:  # a SiteSpec made in Python, not by site_spec
        raise ServerArgsError("--root-path", f"must be '' or '/prefix' without a trailing '/', got {spec.root_path!r}")
    for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
        if not isinstance(getattr(spec, name), str | None):
            raise ServerArgsError("--" + name.replace("_", "-"), f"must be a path, got {getattr(spec, name)!r}")
    if spec.ssl_certfile is None:
        return HttpSite(spec)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(spec.ssl_certfile, spec.ssl_keyfile, password=None if interactive else _no_passphrase)
    except ServerArgsError:
        raise
    except (OSError, ssl.SSLError) as e:
        raise ServerArgsError("--ssl-certfile", f"cannot load the certificate and key: {e}") from None
    if spec.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(cafile=spec.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ServerArgsError("--ssl-ca-certs", f"cannot load it: {e}") from None
    if spec.ssl_cert_reqs is not None:
        try:
            context.verify_mode = ssl.VerifyMode(spec.ssl_cert_reqs)
        except ValueError:
            raise ServerArgsError("--ssl-cert-reqs", f"must be 0, 1 or 2, got {spec.ssl_cert_reqs!r}") from None
    return HttpSite(spec, context)


def _no_passphrase() -> str:
    raise ServerArgsError("--ssl-keyfile", "is encrypted; the Ray gateway actor cannot ask for its passphrase "
                                           "(give a key without one, or serve in process)")


def _absolute(path: str | None) -> str | None:
    # The gateway actor's working directory is Ray's, not the shell's: a relative path would miss there.
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def _root_path(value: str | None) -> str:
    if value is None or value.strip("/") == "":
        return ""
    if not value.startswith("/"):
        raise ServerArgsError("--root-path", f"must start with '/', got {value!r}")
    return value.rstrip("/")


def _under_prefix(prefix: str) -> Middleware:
    # The innermost middleware: a path under the prefix found no route, so it is routed again without the
    # prefix, as aiohttp's own normalize_path_middleware re-routes a request (the outer middleware, auth and
    # errors included, has already run on it). Starlette's root_path answers both ways alike.
    from aiohttp import web

    @web.middleware
    async def under_prefix(request: web.Request, handler: Handler) -> web.StreamResponse:
        raw = request.raw_path  # the path as sent (still %-encoded), with its query
        if request.match_info.http_exception is not None and raw.startswith(prefix) and (
                raw[len(prefix):len(prefix) + 1] in ("/", "?", "")):
            rest = raw[len(prefix):]
            alt = request.clone(rel_url=rest if rest.startswith("/") else "/" + rest)
            match = await request.app.router.resolve(alt)
            if match.http_exception is None:
                match.add_app(request.app)
                match.freeze()
                alt._match_info = match
                return await match.handler(alt)
        return await handler(request)

    return under_prefix
