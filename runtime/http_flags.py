"""The HTTP server's flags: API keys (--api-key, --admin-api-key), the CORS lists and the access log's exclusions, parsed and checked at
start (runtime/config.py calls check_http_flags) so a value the gateway could not honour names its flag
before anything loads. The gateway (runtime/gateway/cors.py, api_keys.py, access_log.py) reads the parsed
forms from here.

Lists take Shoal's comma-separated form or vLLM's JSON list (`--allowed-origins '["https://a.com"]'`, its
only form there: vLLM parses the value with json.loads)."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from runtime.errors import ServerArgsError

if TYPE_CHECKING:
    from runtime.config import ServerArgs

# vLLM's: the key its API server takes when --api-key is not given (`shoal serve` reads it: vllm_flags.py).
# SGLang reads none.
API_KEY_ENV = "VLLM_API_KEY"
# What a browser sends as Origin: scheme://host[:port], or "null" (a sandboxed page, a file:// one).
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s?#]+|null")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110's token: a method or a header name


def api_keys(value: Any, flag: str = "--api-key") -> tuple[str, ...] | None:
    """--api-key as ServerArgs keeps it: a tuple of keys (any one authorizes, as vLLM's several), None for
    none. A str is one key (Engine(api_key="k"), SGLang's single key). An empty key, or one with spaces
    around it, could never be sent back as given: refused rather than leaving the server open or locked
    (an unset shell variable in `--api-key "$KEY"` is the usual cause)."""
    if value is None:
        return None
    keys = (value,) if isinstance(value, str) else value
    if not isinstance(keys, list | tuple) or not keys:
        raise ServerArgsError(flag, f"must be a key or a list of keys, got {value!r}")
    for key in keys:
        if not isinstance(key, str) or not key.strip():
            raise ServerArgsError(flag, f"a key must be a non-empty string, got {key!r} (an unset "
                                        f"variable in {flag} \"$KEY\"?)")
        if key != key.strip() or any(c in key for c in "\r\n"):
            raise ServerArgsError(flag, "a key cannot begin or end with whitespace or hold a line "
                                        "break: no Authorization header could carry it")
    return tuple(dict.fromkeys(keys))


def admin_api_key(value: Any, keys: tuple[str, ...] | None) -> str | None:
    """--admin-api-key (SGLang's, one key): the only key the operator routes take once it is set
    (api_keys.py). One equal to an --api-key would hand them to every inference client: refused."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ServerArgsError("--admin-api-key", f"must be one key (a string), got a {type(value).__name__}")
    api_keys(value, "--admin-api-key")
    if value in (keys or ()):
        raise ServerArgsError("--admin-api-key", "equals an --api-key: every inference client would hold the "
                                                 "operator routes too; give it a key of its own")
    return value


def normalize_http_flags(args: ServerArgs) -> None:
    """The HTTP flags' Python forms (Engine(...) kwargs, YAML lists) as ServerArgs keeps them: key tuples,
    list flags as the JSON text the CLI would give. Called from ServerArgs.__post_init__ (frozen)."""
    object.__setattr__(args, "api_key", api_keys(args.api_key))
    object.__setattr__(args, "admin_api_key", admin_api_key(args.admin_api_key, args.api_key))
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        object.__setattr__(args, name, json_or_list(getattr(args, name)))


def json_or_list(value: Any) -> Any:
    """An Engine(...) / YAML list for a list flag, as the JSON text the CLI would give (lossless)."""
    return json.dumps(list(value)) if isinstance(value, list | tuple) else value


def _items(text: str, flag: str) -> list[str]:
    """A list flag's items: vLLM's JSON list (or one JSON string), else Shoal's comma-separated form."""
    stripped = text.strip()
    if stripped[:1] in ("[", '"'):
        try:
            value = json.loads(stripped)
        except ValueError as e:
            raise ServerArgsError(flag, f"is not valid JSON ({e}): {text!r}") from None
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ServerArgsError(flag, f"must be a JSON list of strings, got {text!r}")
        return [v.strip() for v in items if v.strip()]
    return [v.strip() for v in stripped.split(",") if v.strip()]


def cors_origins(text: str) -> tuple[str, ...]:
    """--allowed-origins as the origins browsers send (lower case, no trailing '/'); ('*',) any, () none.
    An entry no browser could send (a path, no scheme) is refused: it would never match, silently."""
    out = []
    for item in _items(text, "--allowed-origins"):
        origin = item.rstrip("/").lower()
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ServerArgsError("--allowed-origins", f"{item!r} is not an origin: a browser sends "
                                                       "scheme://host[:port] (no path), e.g. https://a.com")
        out.append(origin)
    return ("*",) if "*" in out else tuple(dict.fromkeys(out))


def cors_methods(text: str) -> tuple[str, ...]:
    """--allowed-methods, upper case; ('*',) any. Empty: refused (no preflight could pass)."""
    items = [m.upper() for m in _items(text, "--allowed-methods")]
    return _tokens(items, "--allowed-methods", "method")


def cors_headers(text: str) -> tuple[str, ...]:
    """--allowed-headers, lower case (header names are case-insensitive); ('*',) any; () only the
    CORS-safelisted ones, which every preflight may ask for."""
    items = [h.lower() for h in _items(text, "--allowed-headers")]
    return _tokens(items, "--allowed-headers", "header name") if items else ()


def _tokens(items: list[str], flag: str, what: str) -> tuple[str, ...]:
    if not items:
        raise ServerArgsError(flag, f"names no {what}: give '*' for any")
    for item in items:
        if item != "*" and not _TOKEN.fullmatch(item):
            raise ServerArgsError(flag, f"{item!r} is not a {what}")
    return ("*",) if "*" in items else tuple(dict.fromkeys(items))


def quiet_paths(text: str | None) -> frozenset[str]:
    """--disable-access-log-for-endpoints (vLLM's, comma-separated): paths whose requests get no access
    log line, matched without a query string or a trailing '/'."""
    if text is None:
        return frozenset()
    paths = [p.strip() for p in text.split(",") if p.strip()]
    for path in paths:
        if not path.startswith("/"):
            raise ServerArgsError("--disable-access-log-for-endpoints", f"{path!r} is not a path: each starts "
                                                                         "with '/', e.g. /health,/metrics")
    return frozenset(p.rstrip("/") or "/" for p in paths)


def check_credentials(origins: tuple[str, ...], credentials: bool) -> None:
    """--allow-credentials beside --allowed-origins '*' (its default) or "null" is refused.

    Credentials are what the browser attaches on its own: cookies (an SSO proxy's session in front of the
    server), HTTP auth, TLS client certificates. Allowing them for any origin (Starlette, and so vLLM,
    echoes whatever Origin comes) lets every site a user visits send requests as that user and read the
    answers, which is why browsers refuse '*' with credentials in the first place; "null" is the origin of
    any sandboxed iframe, so any site can send it too. Refused rather than warned: the flag is off by default,
    so whoever gives it wants credentials, and the fix is one flag (the page origins by name), whereas a
    warning scrolls past while the server stays open to every site."""
    if not credentials:
        return
    if "*" in origins:
        raise ServerArgsError("--allow-credentials", "with --allowed-origins '*' (the default) any web site could "
                                                     "send requests carrying a visitor's cookies or client "
                                                     "certificate and read the answers: list the page origins "
                                                     "that may, e.g. --allowed-origins https://ui.example.com")
    if "null" in origins:
        raise ServerArgsError("--allow-credentials", "with --allowed-origins null: \"null\" is the origin of any "
                                                     "sandboxed or file:// page, so any web site can send it; list "
                                                     "the page origins by name")


def check_http_flags(args: ServerArgs) -> None:
    if not 0 < args.port < 65536:
        raise ServerArgsError("--port", f"must be in 1..65535, got {args.port}")
    if not 0 < args.timeout_keep_alive < float("inf"):  # NaN too; 0 would leave an idle socket open for ever
        raise ServerArgsError("--timeout-keep-alive", f"must be a positive number of seconds, got "
                                                      f"{args.timeout_keep_alive}")
    if not 0 <= args.shutdown_timeout_s < float("inf"):
        raise ServerArgsError("--shutdown-timeout-s", f"must be >= 0 seconds, got {args.shutdown_timeout_s}")
    check_credentials(cors_origins(args.allowed_origins), args.allow_credentials)
    cors_methods(args.allowed_methods)
    cors_headers(args.allowed_headers)
    quiet_paths(args.disable_access_log_for_endpoints)
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ServerArgsError("--max-log-len", f"must be >= 0 (characters of a prompt logged), got {args.max_log_len}")
