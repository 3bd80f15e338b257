"""LoraRegistry: the adapters one scheduler serves, by name, as they are loaded and unloaded at run time — a
Mapping of name → id (what requests may name now), the id of each load fresh (never reused: it names the
adapter on the workers and is its prefix-cache namespace, so a reload under the same name never meets the
KV of the weights it replaced), and the live requests of each id.

Unloading removes the name at once (a new request naming it is refused); the requests already running or
waiting keep their id, so they finish with the adapter they started with, and their slot stays theirs. When
the last of them finishes, the id goes to LoraSlots.drops: its slot is freed and every worker forgets its
weights with the next batch. Loads and unloads come from any thread (the gateway's, an actor's); enter /
leave from the scheduler thread; one lock keeps the two views consistent."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from runtime.errors import InvalidRequestError
from runtime.lora.lora_config import LoraNotFoundError, lora_id_of, parse_lora_modules, runtime_spec
from runtime.lora.lora_slots import LoraSlots
from runtime.messages import LoraLoad

if TYPE_CHECKING:
    from runtime.config import ServerArgs
    from runtime.managers.req import Req

NOT_ENABLED = "LoRA is not enabled: start the server with --enable-lora to load adapters"


class LoraRegistry(Mapping[str, int]):
    def __init__(self, args: ServerArgs):
        self.enabled = args.enable_lora
        specs = parse_lora_modules(args.lora_modules) if self.enabled else ()
        self.names: dict[str, int] = {s.name: i for i, s in enumerate(specs, 1)}  # changed in place, under _lock
        self.paths: dict[str, str] = {s.name: s.path for s in specs}
        self.slots = LoraSlots(self.names, args.max_loras) if self.enabled else None
        self._next_id = len(specs) + 1
        self._users: dict[int, set[str]] = {}  # id → rids of the live requests that run it
        self._retired: set[int] = set()  # unloaded ids some request still runs
        self._lock = threading.Lock()
        self._updates = threading.Lock()  # one load or unload at a time (a load reads files: not under _lock)

    # ---- Mapping: name → id of the adapters served now ------------------------------------------
    def __getitem__(self, name: str) -> int:
        return self.names[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.names))

    def __len__(self) -> int:
        return len(self.names)

    def id_of(self, name: str | None, param: str = "model") -> int:
        """Any thread: the id a request naming `name` would run (0: the base model); InvalidRequestError if none."""
        return lora_id_of(self.names, name, param)

    def served(self) -> dict[str, str]:
        """Any thread: name → folder of each adapter served now (/v1/models lists them)."""
        with self._lock:
            return dict(self.paths)

    # ---- scheduler thread: a request's life -----------------------------------------------------
    def enter(self, rid: str, name: str | None) -> int:
        """The id request `rid` runs (0: base), now counted as its user; InvalidRequestError if unloaded meanwhile."""
        if name is None:
            return 0
        with self._lock:
            lora_id = lora_id_of(self.names, name)
            self._users.setdefault(lora_id, set()).add(rid)
        return lora_id

    def leave(self, req: Req) -> None:
        """A request finished (or failed, or was aborted): once an unloaded id has no request left, it goes."""
        if not req.lora_id:
            return
        with self._lock:
            users = self._users.get(req.lora_id)
            if users is None:
                return
            users.discard(req.rid)
            if not users:
                del self._users[req.lora_id]
                if req.lora_id in self._retired:
                    self._drop(req.lora_id)

    # ---- any thread: loads and unloads ----------------------------------------------------------
    def load(self, name: object, path: object, add: Callable[[LoraLoad], None], replace: bool = False) -> LoraLoad:
        """Serves the adapter at `path` as `name` under a fresh id. `add` reads it on every worker (an
        InvalidRequestError naming what is wrong: rank, target modules, shapes, a missing folder) before any
        request can name it. A name already served is refused unless `replace` (vLLM's load_inplace): then
        its running requests finish with the old weights while new ones get the new."""
        if not self.enabled:
            raise InvalidRequestError(NOT_ENABLED, param="lora_name")
        spec = runtime_spec(name, path)
        with self._updates:
            if spec.name in self.names and not replace:
                raise InvalidRequestError(f"The lora adapter '{spec.name}' has already been loaded. To replace it, "
                                          "unload it first (or set load_inplace).", param="lora_name")
            with self._lock:
                load = LoraLoad(lora_id=self._next_id, name=spec.name, path=spec.path)
                self._next_id += 1
            try:
                add(load)
            except Exception:
                self.slots.drops.put(load.lora_id)  # workers that did read it forget it (no request named it)
                raise
            with self._lock:
                if spec.name in self.names:
                    self._retire(spec.name)
                self.names[spec.name], self.paths[spec.name] = load.lora_id, spec.path
        return load

    def unload(self, name: str) -> None:
        """Stops serving `name` now (LoraNotFoundError if it is not served); see the module docstring."""
        if not self.enabled:
            raise InvalidRequestError(NOT_ENABLED, param="lora_name")
        with self._updates, self._lock:
            if name not in self.names:
                raise LoraNotFoundError(name)
            self._retire(name)

    def _retire(self, name: str) -> None:
        """Under _lock: the name goes now; its id once no request runs it."""
        lora_id = self.names.pop(name)
        self.paths.pop(name, None)
        if lora_id in self._users:
            self._retired.add(lora_id)
        else:
            self._drop(lora_id)

    def _drop(self, lora_id: int) -> None:
        self._retired.discard(lora_id)
        self.slots.drops.put(lora_id)
