"""FakeRay: Ray's placement groups and actors as far as ReplicaLauncher uses them, on named fake nodes that can
be lost and revived (tests/cluster/test_relaunch_placement.py)."""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from fake_ray_actors import INFO

from runtime.cluster import placement


@dataclass(eq=False)
class FakePG:
    name: str
    nodes: list[str | None]  # each bundle's node, None while unplaced
    spread: bool
    state: str = "PENDING"

    def ready(self) -> Ref:
        return Ref(lambda: (self.state == "CREATED", self))


@dataclass(eq=False)
class Ref:
    """An ObjectRef: poll() says (ready, value or the exception to raise)."""

    poll: Any


@dataclass(eq=False)
class FakeActor:
    cluster: FakeRay
    pg: FakePG
    bundle: int
    node: str | None = None
    started: bool = False
    killed: bool = False

    def answer(self, method: str, args: tuple) -> tuple[bool, Any]:
        if self.node in self.cluster.gone and not self.started:  # Ray schedules it again, into the new bundle
            self.node = None
        if self.node is None and self.pg.state == "CREATED":  # Ray starts it once its bundle is placed
            self.node = self.pg.nodes[self.bundle]
        if self.killed or self.node in self.cluster.gone:
            return True, RuntimeError("ActorDiedError: the actor died")
        if self.node is None or self.node in self.cluster.dead:
            return False, None  # not started, or on a node that died unnoticed: the call hangs
        self.started = True
        return True, {"endpoint": ("127.0.0.1", 29500), "node_id": self.node, "init": INFO}.get(method, args)

    def __getattr__(self, method: str) -> SimpleNamespace:
        return SimpleNamespace(remote=lambda *args: Ref(lambda: self.answer(method, args)))


class FakeRay:
    """Ray's placement as far as ReplicaLauncher relies on it: a group's bundles are placed all at once (a pending
    group holds nothing), SPREAD over distinct nodes where it can. A killed node is first dead unnoticed (its
    actors hang, its groups still say CREATED); once noticed, Ray reschedules its bundles and keeps the others."""

    def __init__(self, cpus: dict[str, int]):
        self.cpus = cpus
        self.dead: set[str] = set()
        self.gone: set[str] = set()
        self.pgs: list[FakePG] = []
        self.actors: list[FakeActor] = []
        self.lock = threading.RLock()
        self.up = True  # ray.is_initialized()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import ray

        ray_pg = importlib.import_module("ray.util.placement_group")  # ray.util's name is the function
        for name in ("wait", "get", "remote", "kill", "available_resources", "cluster_resources"):
            monkeypatch.setattr(ray, name, getattr(self, name))
        monkeypatch.setattr(ray, "is_initialized", lambda: self.up)
        monkeypatch.setattr(ray_pg, "placement_group", self.placement_group)
        monkeypatch.setattr(ray_pg, "remove_placement_group", self.remove_placement_group)
        monkeypatch.setattr(ray_pg, "placement_group_table", lambda pg: {"state": pg.state})
        monkeypatch.setattr(placement, "bundle_strategy", lambda pg, r: (pg, r))

    # ---- placement ------------------------------------------------------------------------------
    def free(self) -> dict[str, int]:
        held = [n for pg in self.pgs if pg.state != "REMOVED" for n in pg.nodes if n is not None]
        return {n: c - held.count(n) for n, c in self.cpus.items() if n not in self.gone}

    def schedule(self) -> None:
        with self.lock:
            for pg in self.pgs:
                if pg.state not in ("PENDING", "RESCHEDULING"):
                    continue
                free, nodes = self.free(), list(pg.nodes)
                for i in [i for i, n in enumerate(nodes) if n is None]:
                    fits = [n for n in free if free[n] > 0]
                    if not fits:
                        break
                    node = min(fits, key=lambda n: (pg.spread and n in nodes, -free[n], n))
                    nodes[i], free[node] = node, free[node] - 1
                if None not in nodes:  # all of them, or none
                    pg.nodes, pg.state = nodes, "CREATED"

    def placement_group(self, bundles: list[dict], strategy: str, name: str) -> FakePG:
        with self.lock:
            pg = FakePG(name, [None] * len(bundles), strategy == "SPREAD")
            self.pgs.append(pg)
            self.schedule()
            return pg

    def remove_placement_group(self, pg: FakePG) -> None:
        with self.lock:
            pg.state, pg.nodes = "REMOVED", [None] * len(pg.nodes)
            self.schedule()

    def kill_node(self, node: str) -> None:
        self.dead.add(node)

    def notice(self, node: str) -> None:
        with self.lock:
            self.gone.add(node)
            for pg in self.pgs:
                if node in pg.nodes:
                    pg.nodes = [None if n == node else n for n in pg.nodes]
                    pg.state = "RESCHEDULING"
            self.schedule()

    def revive(self, node: str) -> None:
        with self.lock:
            self.dead.discard(node)
            self.gone.discard(node)
            self.schedule()

    def held(self) -> dict[str, list[str | None]]:
        """The nodes of each group that holds bundles, by name (a pending group holds none)."""
        return {pg.name: pg.nodes for pg in self.pgs if any(pg.nodes)}

    # ---- the ray API ----------------------------------------------------------------------------
    def remote(self, cls: type) -> SimpleNamespace:
        def start(**options: Any) -> SimpleNamespace:
            pg, r = options["scheduling_strategy"]

            def create(*args: Any) -> FakeActor:
                actor = FakeActor(self, pg, r)
                self.actors.append(actor)
                return actor
            return SimpleNamespace(remote=create)
        return SimpleNamespace(options=start)

    def wait(self, refs: list[Ref], num_returns: int = 1, timeout: float | None = None, **kw: Any) -> tuple:
        deadline = time.monotonic() + (timeout if timeout is not None else 60.0)
        while True:
            ready = [r for r in refs if r.poll()[0]][:num_returns]
            if len(ready) == num_returns or time.monotonic() >= deadline:
                return ready, [r for r in refs if r not in ready]
            time.sleep(0.005)

    def get(self, refs: Any, timeout: float | None = None) -> Any:
        values = []
        for ref in refs if isinstance(refs, list) else [refs]:
            ready, value = ref.poll()
            assert ready, "a get that would block"
            if isinstance(value, Exception):
                raise value
            values.append(value)
        return values if isinstance(refs, list) else values[0]

    def kill(self, actor: FakeActor, no_restart: bool = True) -> None:
        actor.killed = True

    def available_resources(self) -> dict[str, float]:
        return {"CPU": float(sum(self.free().values()))}

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": float(sum(c for n, c in self.cpus.items() if n not in self.gone))}
