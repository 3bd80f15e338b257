"""ServeLora: LoRA adapters under Ray Serve, where each request reaches one replica of many.

A replica loads adapters on demand, as Ray Serve LLM's `lora_config.dynamic_lora_loading_path` does: with
`dynamic_lora_loading_path` (a folder on every node, one PEFT sub-folder per adapter) in the app's args, a
request whose `model` is not served but names a sub-folder there (`adapter`, or Ray's `<base>:adapter`) has
that replica load it first, through the gateway's own /v1/load_lora_adapter (the admin route's engine load),
then goes on as usual; only a request whose API key the gateway takes does (the load uses the replica's own
key), any other is relayed as it is for the gateway's 401. Both spellings are one adapter, served by its
folder's name (the request is relayed naming it so). Concurrent first requests wait for one load; a load
that failed is a 400 for FAILED_LOAD_TTL_S before a request tries it again. A replica keeps at most
`max_num_adapters_per_replica` adapters so loaded (Ray's 16), unloading the least recently used one that no
request it relays names until its answer ends (a stream: its last chunk); a request for one being unloaded
waits for that and loads it again.

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
import time
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
# Serve's AutoscalingConfig.default() max_replicas: what `num_replicas: auto` may scale to
AUTO_MAX_REPLICAS = 100
FAILED_LOAD_TTL_S = 30.0  # an adapter whose load failed answers that 400 this long before a request tries again
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


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What ServeLora.prepare() made of a request."""

    body: bytes  # what to relay: the request's, its `model` renamed where `<base>:x` is served as x
    held: str | None = None  # the on-demand adapter it names, loaded and held until release()
    error: ApiError | None = None  # the answer instead (an adapter that does not load)


class ServeLora:
    """One replica's side of LoRA under Serve. served(model): whether the gateway serves that name now (its own
    check_model); call(route, payload): the gateway's admin routes, keyed as the replica is."""

    def __init__(self, args: ServerArgs, loading: LoraLoading, served: Callable[[str], bool], call: GatewayCall,
                 clock: Callable[[], float] = time.monotonic):
        self.args, self.loading, self._served, self._call, self._clock = args, loading, served, call, clock
        # On-demand adapters loaded here: name → folder, least recently used first. One being unloaded is in
        # _unloading instead, never in both: a request for it waits for the unload, then loads it again.
        self._loaded: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._loading: dict[str, asyncio.Future[ApiError | None]] = {}
        self._unloading: dict[str, asyncio.Future[None]] = {}
        self._holds: collections.Counter[str] = collections.Counter()  # relayed requests naming each, in flight
        self._failed: dict[str, tuple[float, ApiError]] = {}  # name → (until when, the 400 its load got)
        self._evicting = asyncio.Lock()  # one eviction at a time, each choosing on the state as it is then

    # ---- on-demand loading --------------------------------------------------------------------------------
    async def prepare(self, method: str, body: bytes, headers: Mapping[str, str]) -> Prepared:
        """Before relaying a request: its on-demand adapter loaded and held, or the error to answer instead.
        A request the gateway will refuse for its key changes nothing here (it loads through the replica's
        own key): it is relayed as it is, for the gateway's 401."""
        if self.loading.root is None or method != "POST" or b'"model"' not in body or not self._keyed(headers):
            return Prepared(body)
        try:
            model = msgspec.json.decode(body, type=_ModelField).model
        except msgspec.DecodeError:  # not a JSON object: the gateway's 400 names it
            return Prepared(body)
        target = self._target(model) if isinstance(model, str) else None
        if target is None:
            return Prepared(body)  # not one of ours: the gateway serves it, or its 404 lists what is served
        name, folder = target
        self._holds[name] += 1  # before any await: from here on no eviction chooses it
        try:
            error = await self._ensure(name, folder)
        except BaseException:
            self.release(name)
            raise
        if error is not None:
            self.release(name)
            return Prepared(body, error=error)
        if name in self._loaded:
            self._loaded.move_to_end(name)
        return Prepared(body if name == model else _renamed(body, name), held=name)

    def release(self, name: str | None) -> None:
        """The relayed request naming `name` ended (its response, a stream's last chunk, was sent)."""
        if name is not None:
            self._holds[name] -= 1
            if self._holds[name] <= 0:
                del self._holds[name]

    def _target(self, model: str) -> tuple[str, str] | None:
        """(the name it is served by here, its folder) for a `model` of the loading path: `adapter` or Ray's
        `<base>:adapter`, one adapter under the name `adapter` (a second copy would take a second slot);
        None for a model served another way (the base, args.lora_modules, the admin route's)."""
        if not self._ours(model) and self._served(model):
            return None
        base, colon, rest = model.partition(":")
        adapter = rest if colon and rest and self._served(base) else model
        folder = self._folder(adapter)
        if folder is None:
            return None
        if adapter != model and not self._ours(adapter) and self._served(adapter):
            return model, folder  # `adapter` names another one here: this one is served by the name given
        return adapter, folder

    def _ours(self, name: str) -> bool:
        return name in self._loaded or name in self._loading or name in self._unloading

    def _folder(self, adapter: str) -> str | None:
        """The loading path's sub-folder named `adapter`, if it holds an adapter."""
        assert self.loading.root is not None
        if not _ADAPTER_ID.fullmatch(adapter) or adapter.startswith("."):
            return None
        folder = os.path.join(self.loading.root, adapter)
        return folder if os.path.isfile(os.path.join(folder, "adapter_config.json")) else None

    async def _ensure(self, name: str, folder: str) -> ApiError | None:
        """`name` served here, loaded if need be; the caller holds it, so once loaded it stays. The state is
        read again after every wait: a wait is when other requests load and evict."""
        for _ in range(4):
            unloading = self._unloading.get(name)
            if unloading is not None:  # evicted before this request held it: loaded again once that is done
                await asyncio.shield(unloading)
                continue
            if name in self._loaded:
                if self._served(name):
                    return None
                del self._loaded[name]  # unloaded another way (the admin route, on a one-replica deployment)
            elif self._served(name) and name not in self._loading:
                return None  # loaded another way meanwhile (the admin route): served, and not ours to evict
            error = await self._load_once(name, folder)
            if error is not None:
                return error
        return ApiError(503, f"the LoRA adapter {name!r} was unloaded again and again while this request waited "
                        "for it; retry", code="engine_not_ready")

    async def _load_once(self, name: str, folder: str) -> ApiError | None:
        """One load at a time per name, however many requests wait for it; a load that failed is not tried
        again for FAILED_LOAD_TTL_S (each request naming it would otherwise read the folder again)."""
        failed = self._failed.get(name)
        if failed is not None:
            if self._clock() < failed[0]:
                return failed[1]
            del self._failed[name]
        pending = self._loading.get(name)
        if pending is None:
            pending = self._loading[name] = asyncio.ensure_future(self._load(name, folder))
            pending.add_done_callback(lambda _: self._loading.pop(name, None))
        return await asyncio.shield(pending)

    async def _load(self, name: str, folder: str) -> ApiError | None:
        try:
            status, body = await self._call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder})
        except Exception as e:  # noqa: BLE001 — the replica's own gateway unreachable: it is shutting down
            return ApiError(503, f"the LoRA adapter {name!r} did not load: the replica's gateway did not answer "
                            f"({type(e).__name__}: {e})", code="engine_not_ready")
        if status != 200:
            if self._served(name):  # loaded meanwhile by another way in (the admin route on one replica)
                return None
            message = _error_message(body)
            if status >= 500:  # the engine's state, not the adapter's: the next request tries again
                return ApiError(status, message, code="engine_not_ready" if status == 503 else None)
            error = ApiError(400, f"the LoRA adapter {name!r} (from {PATH_KEY}: {folder}) did not load: {message} "
                             f"(not tried again for {FAILED_LOAD_TTL_S:.0f} s)", param="model", code="invalid_value")
            self._failed[name] = (self._clock() + FAILED_LOAD_TTL_S, error)
            return error
        logger.info("loaded the LoRA adapter %r from %s on first request (%s)", name, folder, PATH_KEY)
        self._loaded[name] = folder
        await self._evict()
        return None

    async def _evict(self) -> None:
        """Over max_num_adapters_per_replica: unloads the least recently used on-demand adapters that no request
        in flight names (the cap is exceeded until one is free, never a request failed for it)."""
        async with self._evicting:
            while len(self._loaded) > self.loading.max_adapters:
                name = next((n for n in self._loaded if not self._holds[n] and n not in self._loading), None)
                if name is None or not await self._unload(name):
                    return

    async def _unload(self, name: str) -> bool:
        """Whether `name` is unloaded. Out of _loaded and into _unloading at once, before the call's await."""
        folder = self._loaded.pop(name)
        done = self._unloading[name] = asyncio.get_running_loop().create_future()
        unloaded = False
        try:
            status, body = await self._call("/v1/unload_lora_adapter", {"lora_name": name})
            unloaded = status in (200, 404)  # 404: unloaded already (the admin route)
            if not unloaded:
                logger.warning("could not unload the LoRA adapter %r: %s", name, _error_message(body))
        except Exception as e:  # noqa: BLE001 — the replica's gateway unreachable (shutting down)
            logger.warning("could not unload the LoRA adapter %r: %s: %s", name, type(e).__name__, e)
        finally:
            del self._unloading[name]
            done.set_result(None)
        if not unloaded and self._served(name):  # still served: counted again, first in line for the next try
            self._loaded[name] = folder
            self._loaded.move_to_end(name, last=False)
        return unloaded

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
            if entry not in listed and self._folder(entry) == folder:
                cards.append({**base, "id": entry, "root": folder, "parent": base["id"]})
        return json.dumps(listing).encode()

    # ---- the admin routes ---------------------------------------------------------------------------------
    async def refusal(self, method: str, path: str, headers: Mapping[str, str]) -> tuple[int, bytes] | None:
        """(status, JSON body) refusing a LoRA admin route on a deployment of several replicas; None to relay it
        (one replica, LoRA off, or a request the gateway will refuse for its key anyway). path: the route, below
        Serve's root path (its http_options.root_path and the app's route_prefix: serve_relay.route_path)."""
        if method != "POST" or path not in ADMIN_ROUTES or not self.args.enable_lora or not self._operator(headers):
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

    def _operator(self, headers: Mapping[str, str]) -> bool:
        """The caller holds what the gateway's operator routes take: --admin-api-key where set (SGLang's rule),
        else an --api-key."""
        if self.args.admin_api_key is None:
            return self._keyed(headers)
        return _bearer_in(headers, (self.args.admin_api_key,))

    def _keyed(self, headers: Mapping[str, str]) -> bool:
        keys = self.args.api_key or ()
        return not keys or _bearer_in(headers, keys)


def _bearer_in(headers: Mapping[str, str], keys: tuple[str, ...]) -> bool:
    """The request's `Authorization: Bearer <key>` is one of keys (compared in constant time)."""
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
    if num_replicas == "auto":  # Serve's default autoscaling (the config as written, not yet filled in)
        return DeploymentScale(AUTO_MAX_REPLICAS, autoscaling=True)
    return DeploymentScale(num_replicas if isinstance(num_replicas, int) else 1, autoscaling=False)


def _renamed(body: bytes, model: str) -> bytes:
    """The request's JSON object with `model` replaced (prepare() has decoded it as an object already)."""
    request = msgspec.json.decode(body)
    request["model"] = model
    return msgspec.json.encode(request)


def _error_message(body: bytes) -> str:
    """The message of a gateway error body (OpenAI's shape), else the body as text."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace").strip()[:500]
