"""ServeLora: LoRA adapters under Ray Serve, where each request reaches one replica of many.

A replica loads adapters on demand, as Ray Serve LLM's `lora_config.dynamic_lora_loading_path` does: with
`dynamic_lora_loading_path` (a folder on every node, one PEFT sub-folder per adapter) in the app's args, a
request whose `model` is not served but names a sub-folder there (`adapter`, or Ray's `<base>:adapter`) has
that replica load it first, through the gateway's own /v1/load_lora_adapter (the admin route's engine load),
then goes on as usual. Concurrent first requests wait for one load. A replica keeps at most
`max_num_adapters_per_replica` adapters so loaded (Ray's 16), unloading the least recently used one that no
request it relays still names (running requests keep their adapter anyway: runtime/lora/lora_registry.py).

The admin routes themselves (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter and SGLang's) would
change the one replica that got the request: the others would answer 404 for the adapter, and replicas
autoscaling adds later would never have it. So where the deployment can have more than one replica they
are refused with a 400 that says what works instead: args.lora_modules, or the loading path."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec

from runtime.config import ServerArgs
from runtime.errors import ServerArgsError
from runtime.gateway.errors import ApiError
from runtime.gateway.protocol import encode

logger = logging.getLogger(__name__)

PATH_KEY = "dynamic_lora_loading_path"
MAX_KEY = "max_num_adapters_per_replica"
DEFAULT_MAX_ADAPTERS = 16  # Ray Serve LLM's LoraConfig default
ADMIN_ROUTES = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/load_lora_adapter",
                          "/unload_lora_adapter"})
_REMOTE = ("s3://", "gs://", "abfss://", "azure://", "http://", "https://")
# One path component, as Ray's adapter ids are (they may hold ':'): never a way out of the folder.
_ADAPTER_ID = re.compile(r"[^/\\\x00]+")

# (status, body) of a gateway call: how ServeLora reaches the replica's own gateway.
GatewayCall = Callable[[str, dict[str, Any]], Awaitable[tuple[int, bytes]]]


@dataclasses.dataclass(frozen=True)
class LoraLoading:
    """The app args' on-demand loading keys (not ServerArgs fields: Serve-level, as Ray's lora_config)."""

    root: str | None = None  # the folder; None: no on-demand loading
    max_adapters: int = DEFAULT_MAX_ADAPTERS

    @classmethod
    def split(cls, kwargs: Mapping[str, Any], names: Mapping[str, str] | None = None
              ) -> tuple[dict[str, Any], LoraLoading]:
        """(the ServerArgs kwargs, the loading keys) of an app's flat args; ServerArgsError naming the args key
        (names: flat key -> the YAML key it came from) for a bad one. The path implies enable_lora."""
        names = names or {}
        rest = dict(kwargs)
        root, most = rest.pop(PATH_KEY, None), rest.pop(MAX_KEY, DEFAULT_MAX_ADAPTERS)
        if root is not None:
            if not isinstance(root, str) or not root:
                raise ServerArgsError(names.get(PATH_KEY, PATH_KEY), f"must be a folder path, got {root!r}")
            if root.startswith(_REMOTE):
                raise ServerArgsError(names.get(PATH_KEY, PATH_KEY), f"{root!r}: Shoal loads adapters from a "
                                      "folder every node can read (sync the bucket there), not from a URI")
            if rest.get("enable_lora") is False:
                raise ServerArgsError(names.get(PATH_KEY, PATH_KEY), "loads LoRA adapters: enable_lora must "
                                      f"not be false ({names.get('enable_lora', 'enable_lora')})")
            rest["enable_lora"] = True
        if isinstance(most, bool) or not isinstance(most, int) or most < 1:
            raise ServerArgsError(names.get(MAX_KEY, MAX_KEY), f"must be a positive integer, got {most!r}")
        return rest, cls(root.rstrip("/") or "/" if root is not None else None, most)

    def check_here(self) -> None:
        """On the replica's node (build_app's may be another): the folder must be there."""
        if self.root is not None and not os.path.isdir(self.root):
            raise ServerArgsError(PATH_KEY, f"{self.root!r} is not a folder on this node")


class _ModelField(msgspec.Struct):
    model: Any = None


class ServeLora:
    """One replica's side of LoRA under Serve. served(model): whether the gateway serves that name now (its own
    check_model); call(route, payload): the gateway's admin routes, keyed as the replica is."""

    def __init__(self, args: ServerArgs, loading: LoraLoading, served: Callable[[str], bool], call: GatewayCall):
        self.args, self.loading, self._served, self._call = args, loading, served, call
        self._loaded: collections.OrderedDict[str, str] = collections.OrderedDict()  # on-demand: name → folder, LRU first
        self._loading: dict[str, asyncio.Future[ApiError | None]] = {}
        self._holds: collections.Counter[str] = collections.Counter()  # relayed requests naming each, in flight

    # ---- on-demand loading --------------------------------------------------------------------------------
    async def prepare(self, method: str, body: bytes) -> tuple[str | None, ApiError | None]:
        """Before relaying a request: (the on-demand adapter it names, now loaded and held until release(),
        or None; the error to answer instead, e.g. an adapter that does not load)."""
        if self.loading.root is None or method != "POST" or b'"model"' not in body:
            return None, None
        try:
            model = msgspec.json.decode(body, type=_ModelField).model
        except msgspec.DecodeError:  # not a JSON object: the gateway's 400 names it
            return None, None
        if not isinstance(model, str):
            return None, None
        for _ in range(3):  # again if another load evicted it before this request could hold it
            if self._served(model):
                break
            folder = self.adapter_folder(model)
            if folder is None:
                return None, None  # not one of ours: the gateway's 404 lists what is served
            error = await self._load_once(model, folder)
            if error is not None:
                return None, error
        if model not in self._loaded:
            return None, None
        self._loaded.move_to_end(model)
        self._holds[model] += 1
        return model, None

    def release(self, name: str | None) -> None:
        if name is not None:
            self._holds[name] -= 1
            if self._holds[name] <= 0:
                del self._holds[name]

    def adapter_folder(self, model: str) -> str | None:
        """The loading path's sub-folder `model` names (`adapter` or `<base>:adapter`), if it holds an adapter."""
        assert self.loading.root is not None
        base, colon, rest = model.partition(":")
        adapter = rest if colon and rest and self._served(base) else model
        if not _ADAPTER_ID.fullmatch(adapter) or adapter.startswith("."):
            return None
        folder = os.path.join(self.loading.root, adapter)
        return folder if os.path.isfile(os.path.join(folder, "adapter_config.json")) else None

    async def _load_once(self, name: str, folder: str) -> ApiError | None:
        pending = self._loading.get(name)
        if pending is None:
            pending = self._loading[name] = asyncio.ensure_future(self._load(name, folder))
            pending.add_done_callback(lambda _: self._loading.pop(name, None))
        return await asyncio.shield(pending)

    async def _load(self, name: str, folder: str) -> ApiError | None:
        status, body = await self._call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder})
        if status != 200:
            if self._served(name):  # loaded meanwhile by another way in (the admin route on one replica)
                return None
            message = _error_message(body)
            if status >= 500:
                return ApiError(status, message, code="engine_not_ready" if status == 503 else None)
            return ApiError(400, f"the LoRA adapter {name!r} (from {PATH_KEY}: {folder}) did not load: {message}",
                            param="model", code="invalid_value")
        logger.info("loaded the LoRA adapter %r from %s on first request (%s)", name, folder, PATH_KEY)
        self._loaded[name] = folder
        await self._evict(keep=name)
        return None

    async def _evict(self, keep: str) -> None:
        """Over max_num_adapters_per_replica: unloads the least recently used on-demand adapters that no request
        in flight names (the cap is exceeded until one is free, never a request failed for it)."""
        for name in list(self._loaded):
            if len(self._loaded) <= self.loading.max_adapters:
                return
            if name == keep or self._holds[name] or name in self._loading:
                continue
            del self._loaded[name]
            status, body = await self._call("/v1/unload_lora_adapter", {"lora_name": name})
            if status not in (200, 404):  # 404: unloaded already (the admin route)
                logger.warning("could not unload the LoRA adapter %r: %s", name, _error_message(body))

    def with_loadable(self, body: bytes) -> bytes:
        """GET /v1/models' answer plus a card for each adapter of the loading path not loaded here yet, so that
        every replica lists the same models (and the ones any request may name)."""
        if self.loading.root is None:
            return body
        try:
            listing = json.loads(body)
            cards = listing["data"]
            base, listed = cards[0], {c["id"] for c in cards}
            entries = sorted(os.listdir(self.loading.root))
        except (ValueError, KeyError, IndexError, TypeError, OSError):
            return body
        for entry in entries:
            folder = os.path.join(self.loading.root, entry)
            if entry not in listed and self.adapter_folder(entry) == folder:
                cards.append({**base, "id": entry, "root": folder, "parent": base["id"]})
        return json.dumps(listing).encode()

    # ---- the admin routes ---------------------------------------------------------------------------------
    async def refusal(self, method: str, path: str, headers: Mapping[str, str]) -> tuple[int, bytes] | None:
        """(status, JSON body) refusing a LoRA admin route on a deployment of several replicas; None to relay it
        (one replica, LoRA off, or a request the gateway will refuse for its key anyway)."""
        if method != "POST" or path not in ADMIN_ROUTES or not self.args.enable_lora or not self._keyed(headers):
            return None
        scale = await deployment_scale()
        if scale is None or scale.max_replicas <= 1:
            return None
        message = (f"{path} would change only the replica this request reached, of {scale}: the others would "
                   "answer 404 for the adapter, and replicas added later would not have it. List the adapters "
                   "in the app's args.lora_modules (every replica loads them at start), or set "
                   f"args.{PATH_KEY} to a folder of adapters (a replica loads one on the first request naming "
                   "it); see deploy/README.md")
        if path.startswith("/v1/"):
            return 400, encode(ApiError(400, message, param="lora_name", code="unsupported").body())
        return 400, json.dumps({"success": False, "error_message": message, "loaded_adapters": None}).encode()

    def _keyed(self, headers: Mapping[str, str]) -> bool:
        keys = self.args.api_key or ()
        if not keys:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        sent = token.strip().encode("utf-8", "surrogateescape")
        return scheme.lower() == "bearer" and any(hmac.compare_digest(sent, k.encode()) for k in keys)


@dataclasses.dataclass(frozen=True)
class DeploymentScale:
    max_replicas: int
    autoscaling: bool

    def __str__(self) -> str:
        if self.autoscaling:
            return f"a deployment autoscaling up to {self.max_replicas} replicas"
        return f"a deployment of {self.max_replicas} replicas (num_replicas)"


async def deployment_scale() -> DeploymentScale | None:
    """How many replicas this replica's deployment may have: its target config as Serve's controller holds it
    (a `serve deploy` that changed num_replicas reaches no replica), else the config the replica started
    with; None outside a replica."""
    from ray import serve

    try:
        context = serve.get_replica_context()
    except Exception:  # noqa: BLE001 — not in a replica (RayServeException), or a Ray without it
        return None
    try:
        from ray.serve.context import _get_global_client

        details = await _get_global_client()._controller.get_serve_instance_details.remote()
        config = details["applications"][context.app_name]["deployments"][context.deployment]["deployment_config"]
        autoscaling = config.get("autoscaling_config")
        return _scale(config.get("num_replicas"), autoscaling and autoscaling.get("max_replicas"))
    except Exception:  # noqa: BLE001 — the controller's answer changed shape, or it is unreachable
        logger.debug("Serve's controller did not say the deployment's scale", exc_info=True)
    config = context._deployment_config
    autoscaling = getattr(config, "autoscaling_config", None)
    return _scale(getattr(config, "num_replicas", None), getattr(autoscaling, "max_replicas", None))


def _scale(num_replicas: Any, max_replicas: Any) -> DeploymentScale:
    if max_replicas is not None:
        return DeploymentScale(int(max_replicas), autoscaling=True)
    return DeploymentScale(num_replicas if isinstance(num_replicas, int) else 1, autoscaling=False)


def _error_message(body: bytes) -> str:
    """The message of a gateway error body (OpenAI's shape), else the body as text."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace").strip()[:500]
