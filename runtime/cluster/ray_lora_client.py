"""RayLoraClient: RayEngineClient's LoRA adapters loaded and unloaded at run time (kept here:
ray_engine_client.py is at its size limit). A load goes to every live routing target's scheduler actor (each
replica, each DP rank), which has each of its TP ranks read the adapter before it serves it; it succeeds
everywhere or is undone where it did. The client keeps the adapters served, so a relaunched replica (which
starts with --lora-modules) is brought to the same set before it takes traffic. All of it runs on the
client's own loop, one update at a time."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from runtime.errors import InvalidRequestError
from runtime.lora.lora_config import LoraNotFoundError, parse_lora_modules, runtime_spec
from runtime.lora.lora_registry import NOT_ENABLED
from runtime.messages import LoraUpdate

logger = logging.getLogger(__name__)


class RayLoraClient:
    """A mixin of RayEngineClient: it uses its args, replicas, _loop, _actor() and _targets_of()."""

    args: Any
    replicas: list[Any]
    _loop: asyncio.AbstractEventLoop
    _restarting: set[int]

    def _init_loras(self) -> None:
        specs = parse_lora_modules(self.args.lora_modules) if self.args.enable_lora else ()
        self._lora_start = {s.name: s.path for s in specs}  # what a (re)launched replica serves
        self._lora_served = dict(self._lora_start)  # what every replica serves now
        self._lora_lock: asyncio.Lock | None = None  # created on the client loop, where every update runs

    def lora_adapters(self) -> dict[str, str]:
        return dict(self._lora_served)

    async def add_lora(self, name: str, path: str, replace: bool = False) -> None:
        await self._on_client_loop(self._load(name, path, replace))

    async def remove_lora(self, name: str) -> None:
        await self._on_client_loop(self._unload(name))

    async def _on_client_loop(self, coro: Any) -> None:
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _lock(self) -> asyncio.Lock:
        if self._lora_lock is None:
            self._lora_lock = asyncio.Lock()
        return self._lora_lock

    async def _load(self, name: str, path: str, replace: bool) -> None:
        if not self.args.enable_lora:
            raise InvalidRequestError(NOT_ENABLED, param="lora_name")
        spec = runtime_spec(name, path)
        async with self._lock():
            if spec.name in self._lora_served and not replace:
                raise InvalidRequestError(f"The lora adapter '{spec.name}' has already been loaded. To replace it, "
                                          "unload it first (or set load_inplace).", param="lora_name")
            targets = [r.index for r in self.replicas if r.alive]
            answers = await self._call(targets, "load_lora_adapter", spec.name, spec.path, replace)
            failed = [a for a in answers if a.error is not None]
            if failed:
                if not replace:  # undo where it loaded: every replica serves the same adapters
                    loaded = [i for i, a in zip(targets, answers) if a.error is None]
                    await self._call(loaded, "unload_lora_adapter", spec.name)
                raise InvalidRequestError(failed[0].error, param="lora_path")
            self._lora_served[spec.name] = spec.path

    async def _unload(self, name: str) -> None:
        if not self.args.enable_lora:
            raise InvalidRequestError(NOT_ENABLED, param="lora_name")
        async with self._lock():
            if name not in self._lora_served:
                raise LoraNotFoundError(name)
            answers = await self._call([r.index for r in self.replicas if r.alive], "unload_lora_adapter", name)
            del self._lora_served[name]  # gone where it was (a replica without it has nothing to unload)
            failed = [a.error for a in answers if a.error is not None and not a.not_found]
            if failed:
                raise InvalidRequestError(failed[0], param="lora_name")

    async def _restore_loras(self, group_index: int) -> None:
        """A relaunched replica group (its links and pumps up): from --lora-modules' adapters to the ones served
        now, then routed to, under the lock, so no load or unload runs between the two."""
        async with self._lock():
            targets = self._targets_of(group_index)
            for name, path in self._lora_start.items():
                if self._lora_served.get(name) != path:
                    await self._call(targets, "unload_lora_adapter", name)
            for name, path in self._lora_served.items():
                if self._lora_start.get(name) != path:
                    for a in await self._call(targets, "load_lora_adapter", name, path, True):
                        if a.error is not None:
                            logger.error("relaunched replica %d cannot serve LoRA adapter %r: %s", group_index,
                                         name, a.error)
            if group_index not in self._restarting:  # routed to from here on: a load waiting on the lock reaches it
                for i in targets:
                    self.replicas[i].alive = True

    async def _call(self, targets: list[int], method: str, *args: Any) -> list[LoraUpdate]:
        """One typed answer per target; an actor that fails to answer counts as that target's error."""
        results = await asyncio.gather(*(getattr(self._actor(i), method).remote(*args) for i in targets),
                                       return_exceptions=True)
        return [r if isinstance(r, LoraUpdate) else LoraUpdate(error=f"routing target {i}: {type(r).__name__}: {r}")
                for i, r in zip(targets, results)]
