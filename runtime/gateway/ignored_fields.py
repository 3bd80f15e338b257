"""IgnoredFields: the keys of a request body that its protocol Struct does not declare, at any depth
(`store`, `stream_options.include_obfuscation`, `messages[].colour`). The body is accepted without them,
as vLLM and SGLang accept it; each name is logged once and counted in
`shoal:ignored_request_fields_total{field=...}`, so an operator sees what clients send that Shoal does
not act on.

The scan runs after the typed decode succeeded, over msgspec.Raw slices of the same bytes: it never
parses a value, so it cannot fail where the decode did not, and it only descends into declared fields
whose type holds a Struct."""

from __future__ import annotations

import functools
import logging
from typing import Any

import msgspec
from msgspec import Raw, inspect
from prometheus_client import Counter

logger = logging.getLogger("shoal.gateway")

# A client can make up any key: past this many distinct names the counter's label is "_other", so the
# metric's size stays bounded. Names are cut to _MAX_NAME characters for the same reason.
_MAX_NAMES = 64
_MAX_NAME = 80
_OTHER = "_other"
_Json = dict[str, Raw] | list[Raw] | None


class _Shape(msgspec.Struct, frozen=True):
    """A Struct's declared JSON keys, and for the ones holding Structs, the shape of those."""

    known: frozenset[str]
    objects: dict[str, _Shape]  # key → a Struct value (or null)
    arrays: dict[str, _Shape]  # key → a list of Structs (or null)


@functools.cache
def _shape(kind: type) -> _Shape:
    info = inspect.type_info(kind)
    objects: dict[str, _Shape] = {}
    arrays: dict[str, _Shape] = {}
    for f in info.fields:
        for t in f.type.types if isinstance(f.type, inspect.UnionType) else (f.type,):
            if isinstance(t, inspect.StructType):
                objects[f.encode_name] = _shape(t.cls)
            elif isinstance(t, inspect.ListType) and isinstance(t.item_type, inspect.StructType):
                arrays[f.encode_name] = _shape(t.item_type.cls)
    return _Shape(frozenset(f.encode_name for f in info.fields), objects, arrays)


def unknown_keys(raw: bytes | Raw, kind: type) -> list[str]:
    """Paths of the keys in raw (a JSON object that decodes as kind) that kind does not declare."""
    out: list[str] = []
    _scan(raw, _shape(kind), "", out)
    return out


def _decode(raw: bytes | Raw) -> Any:
    try:
        return msgspec.json.decode(raw, type=_Json)
    except msgspec.ValidationError:  # a value the typed decode took in another form: nothing declared inside
        return None


def _scan(raw: bytes | Raw, shape: _Shape, prefix: str, out: list[str]) -> None:
    obj = _decode(raw)
    if not isinstance(obj, dict):
        return
    for key, value in obj.items():
        if key not in shape.known:
            out.append(prefix + key)
        elif key in shape.objects:
            _scan(value, shape.objects[key], f"{prefix}{key}.", out)
        elif key in shape.arrays:
            items = _decode(value)
            for item in items if isinstance(items, list) else ():
                _scan(item, shape.arrays[key], f"{prefix}{key}[].", out)


class IgnoredFields:
    def __init__(self, counter: Counter):
        self.counter = counter
        self.seen: set[str] = set()

    def note(self, raw: bytes, kind: type, route: str) -> list[str]:
        """Logs (once per name) and counts the unknown keys of an accepted body; returns their paths."""
        paths = unknown_keys(raw, kind)
        self.count(paths, route)
        return paths

    def count(self, paths: list[str], route: str) -> None:
        """Logs (once per name) and counts fields a handler accepted without acting on them: the unknown
        keys, and declared ones whose value asks for nothing Shoal can do (Responses' reasoning.effort)."""
        for path in paths:
            name = path[:_MAX_NAME]
            if name not in self.seen:
                if len(self.seen) >= _MAX_NAMES:
                    name = _OTHER
                else:
                    self.seen.add(name)
                    logger.info("ignoring request field %r (first seen on %s): Shoal does not use it", name, route)
            self.counter.labels(field=name).inc()
