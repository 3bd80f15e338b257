"""RequestIds: how one app names its responses, as vLLM does. A request that sends the X-Request-Id header, or
else vLLM's body field `request_id` (chat, completions, /v1/responses, /v1/embeddings, /pooling, /classify),
is named by it: new_id(prefix) gives "<prefix>-<id>" (chatcmpl-<id>, cmpl-<id>, embd-<id>, gen-<id>, ...;
its choices' rids add -<k> as always) rather than a random id, and /abort_request finds it by either. The
header goes first, as vLLM's _base_request_id takes it; a body id that is not 1-256 visible ASCII characters
is a 400 naming request_id even then (bad input is never passed over in silence). /v1/responses differs, as
vLLM's does: its body request_id is the response id verbatim (no resp_ added) and goes before the header,
which vLLM's Responses API never reads for the id (new_id's as_sent); the header alone still names it
resp_<header>, where vLLM would draw a random resp_<uuid>.

Where that id could clash with an engine rid still in use (the same id in flight or dropped less than
RETIRED_ID_S ago, whose abort the engine has yet to take; or a lookalike such as "x-0" beside "x" with n=2,
whose choices are x-0 and x-1), the request gets "<prefix>-<id>-<8 hex>": every response id names one
request, so aborting by it never stops another (vLLM now keeps the client's id as the response id and makes
only its engine ids unique). Not a 400: a proxy that retries a timed-out attempt sends the same id while the
first may still be running. An empty header counts as none. The middleware (app.py) opens scope() around
each handler.

X-Request-Id comes back on every response (response_header), as vLLM's --enable-request-id-headers sends it:
the client's own where it is well formed (1-256 visible ASCII: a rejected one is never echoed); else the id
this request's first response id was made from (chatcmpl-<hex> answers <hex>, a body request_id answers
itself), so the header names the request the same way whether the client sent one or not; else (no id made:
an error before it, a route that names nothing) a random uuid hex, as vLLM's."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from runtime.gateway.errors import bad_request

RETIRED_ID_S = 30.0  # a client's id stays taken this long after its handler returned (_clashes)
# Visible ASCII, bounded: the id is repeated in every chunk of a stream, and the header is echoed back.
_FORM = re.compile(r"[\x21-\x7e]{1,256}")
ID_RULE = "1-256 visible ASCII characters (no spaces)"  # _FORM in words, for the 400s that name it


def well_formed_id(value: str) -> bool:
    """Whether value has the form of a client's id (_FORM): what the logs may print as sent, as nothing in
    it can end a line or forge a field."""
    return _FORM.fullmatch(value) is not None


def _choice_of(rid: str, base: str) -> bool:
    """Whether rid is the rid of a choice of base: base-<k>."""
    return rid.startswith(base) and rid[len(base):len(base) + 1] == "-" and rid[len(base) + 1:].isdigit()


class IdScope:
    """One HTTP request's X-Request-Id (None: not sent) and the ids new_id made for it."""

    __slots__ = ("header", "made", "closed", "base")

    def __init__(self, header: str | None):
        self.header = header or None  # an empty header is none, as an absent one
        self.made: list[str] = []
        self.closed = False  # the handler returned: a task it left behind gets random ids (nothing releases them)
        self.base: str | None = None  # the id its first response id was made from: what X-Request-Id answers


# The handler's own request (aiohttp runs each in its task, so each sees its own): a ContextVar is made once,
# at import, as Python asks, and holds nothing between requests.
_CURRENT: ContextVar[IdScope | None] = ContextVar("shoal_request_ids", default=None)


def current_scope() -> IdScope | None:
    """The running handler's scope (None outside one): the middleware keeps it on its request for the header."""
    return _CURRENT.get()


def response_header(sent: str | None, scope: IdScope | None) -> str:
    """The X-Request-Id to answer with: the client's own if it is well formed (_FORM: one it could be named by;
    a longer or odd one is never echoed, so a client cannot make every answer carry kilobytes of its header),
    else the id its response was named by, else a random uuid hex (vLLM's)."""
    if sent and _FORM.fullmatch(sent):
        return sent
    if scope is not None and scope.base is not None:
        return scope.base
    return uuid.uuid4().hex


class RequestIds:
    def __init__(self, inflight: dict[str, list[str]]):
        self.inflight = inflight  # GatewayState's: response id → rids of its choices
        self.named: dict[str, str] = {}  # an id new_id made from a client's id → that id, while its handler runs
        self._retired: dict[str, float] = {}  # such an id whose handler returned → until when it stays taken

    @contextmanager
    def scope(self, header: str | None) -> Iterator[None]:
        """Around one handler: new_id names its ids by header (X-Request-Id, None: not sent) or the body's id."""
        ids = IdScope(header)
        token = _CURRENT.set(ids)
        try:
            yield
        finally:
            _CURRENT.reset(token)
            ids.closed = True
            retire = time.monotonic() + RETIRED_ID_S
            for made in ids.made:
                self.named.pop(made, None)
                self._retired[made] = retire

    def new_id(self, prefix: str, sep: str = "-", request_id: str | None = None, as_sent: bool = False) -> str:
        """A response id: "<prefix><sep><id>", the id being the request's X-Request-Id, else request_id (the
        body's), suffixed where it would clash; else a random one. A bad header or body id is a 400 naming it.
        as_sent: request_id, when given, is the response id itself, unprefixed and before the header (vLLM's
        Responses API answers with its body request_id verbatim, resp_<uuid> by default, and reads no header
        for it). Outside a handler: random."""
        if request_id is not None and not _FORM.fullmatch(request_id):
            raise bad_request("request_id must be 1-256 visible ASCII characters (no spaces)", param="request_id")
        ids = _CURRENT.get()
        if ids is not None and ids.header is not None and not ids.closed and not _FORM.fullmatch(ids.header):
            raise bad_request("the X-Request-Id header must be 1-256 visible ASCII characters (no spaces)",
                              param="X-Request-Id")
        verbatim = as_sent and request_id is not None
        name = None if ids is None or ids.closed else request_id if verbatim else ids.header or request_id
        if name is None:
            drawn = uuid.uuid4().hex
            if ids is not None and not ids.closed and ids.base is None:
                ids.base = drawn
            return f"{prefix}{sep}{drawn}"
        if ids.base is None:
            ids.base = name
        stem = name if verbatim else f"{prefix}{sep}{name}"
        rid = stem
        while self._clashes(rid):
            rid = f"{stem}-{uuid.uuid4().hex[:8]}"
        self.named[rid] = name
        ids.made.append(rid)
        return rid

    def _clashes(self, rid: str) -> bool:
        """Whether rid, or a choice's rid made from it (rid-<k>), could equal an engine rid still in use: a
        named id in flight, or one whose handler returned less than RETIRED_ID_S ago (a client that dropped
        its connection: the engine frees the rids at its next step), or an id that is one of these plus -<k>
        or the other way round (X-Request-Id "x-0" beside "x" with n=2). Only named ids are scanned: random
        ones cannot clash. (A suffix of digits only would look like a choice: drawn again.)"""
        now = time.monotonic()
        while self._retired and next(iter(self._retired.values())) < now:  # oldest first (insertion order)
            del self._retired[next(iter(self._retired))]
        return any(live == rid or _choice_of(live, rid) or _choice_of(rid, live)
                   for live in (*self.named, *self._retired, *self.inflight))

    def rids_of(self, rid: str) -> list[str]:
        """What /abort_request stops for rid: the choices of the response it names, or of every request in
        flight that sent it (as X-Request-Id or request_id); else rid itself (one engine request's own rid)."""
        if rid in self.inflight:
            return self.inflight[rid]
        named = [r for made, name in self.named.items() if name == rid for r in self.inflight.get(made, ())]
        return named or [rid]
