"""A replica relaunch after a node is lost, without Ray: FakeRay stands in for Ray's placement and actors as far
as ReplicaLauncher uses them. Two TP=2 replicas spread over two nodes; the second node dies. Its actors hang
until Ray notices the node is gone, and then Ray keeps each group's surviving bundle, so between them the two
groups hold the whole node left and neither could come back. A relaunch's wait ends once its group lost
bundles (or its actors did not start in time); the group is released, a fresh one is reserved, one replica
comes back on the node left and the other waits holding nothing, saying what it waits for, until the node
returns. The client's /health reason carries that wait, and a relaunch keeps retrying without a traceback.
A follower's death seen while the group is being stopped is not logged as a failure."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from fake_ray_actors import INFO, FakeLauncher, FakeScheduler, fake_client

from runtime.cluster import launch, placement, replica_group, replica_health, scheduler_actor
from runtime.cluster.launch import ReplicaLauncher, ReplicaStartError, replica_group_name
from runtime.cluster.tp_rank import RankSpec
from runtime.config import ServerArgs
from runtime.errors import EngineUnavailableError


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

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import ray

        ray_pg = importlib.import_module("ray.util.placement_group")  # ray.util's name is the function
        for name in ("wait", "get", "remote", "kill", "available_resources", "cluster_resources"):
            monkeypatch.setattr(ray, name, getattr(self, name))
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


@pytest.fixture
def fake_ray(monkeypatch) -> FakeRay:
    ray = FakeRay({"A": 2, "B": 2})
    ray.install(monkeypatch)
    monkeypatch.setattr(placement, "POLL_S", 0.01)
    monkeypatch.setattr(placement, "WAIT_LOG_S", 0.05)
    monkeypatch.setattr(placement, "PLACEMENT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(replica_group, "STOP_WAIT_S", 0.05)
    return ray


def spread_launcher() -> ReplicaLauncher:
    return ReplicaLauncher(ServerArgs(model_path="m", tp_size=2, dp_size=2, placement="spread", device="cpu"), "m")


def name(g: int) -> str:
    return replica_group_name(g, os.getpid())


def relaunch(launcher: ReplicaLauncher, g: int, stop: threading.Event, errors: list[str]) -> Any:
    """As RayEngineClient does: relaunch replica g until it serves (or stop), each failure noted."""
    for generation in itertools.count(1):
        if stop.is_set():
            return None
        try:
            return launcher.launch(g, generation)
        except EngineUnavailableError as e:
            errors.append(str(e))
        time.sleep(0.01)


def test_a_lost_node_frees_both_groups_and_one_replica_comes_back(fake_ray):
    launcher = spread_launcher()
    groups = launcher.launch_all()
    assert fake_ray.held() == {name(0): ["A", "B"], name(1): ["A", "B"]}
    fake_ray.kill_node("B")
    for g in groups:
        g.kill()
    stop = threading.Event()
    errors: list[list[str]] = [[], []]
    with ThreadPoolExecutor(2) as pool:  # the client relaunches both at once, each from its own thread
        relaunches = [pool.submit(relaunch, launcher, g, stop, errors[g]) for g in range(2)]
        try:
            time.sleep(0.2)
            assert not any(f.done() for f in relaunches)  # rank 1 hangs on the dead node until Ray notices
            fake_ray.notice("B")
            # One whole replica fits on the node left: it comes back; the other waits, holding nothing.
            deadline = time.monotonic() + 10
            while sum(f.done() for f in relaunches) != 1 or not any("cannot place" in e for e in sum(errors, [])):
                assert time.monotonic() < deadline, errors
                time.sleep(0.01)
            won = next(g for g, f in enumerate(relaunches) if f.done())
            lost = 1 - won
            assert relaunches[won].result().node_ids() == ["A", "A"] and fake_ray.held() == {name(won): ["A", "A"]}
            assert errors[lost][-1].startswith(f"cannot place {name(lost)} within 0 s")
            assert launcher.waiting == {lost: f"2 x {{'CPU': 1.0}} (spread) for {name(lost)}, free now {{'CPU': 0.0}}"}
            fake_ray.revive("B")
            assert relaunches[lost].result(timeout=10).node_ids() == ["B", "B"]
        finally:
            stop.set()  # a failed check must not leave the loops retrying
    assert launcher.waiting == {}
    assert any(f"its placement group {name(g)} lost bundles (it is RESCHEDULING) (rank 1 not done)" in e
               for g in range(2) for e in errors[g]), errors  # the wait that hung before
    launcher.shutdown()
    assert fake_ray.held() == {}


def test_actors_that_never_start_time_out_and_release_their_group(fake_ray, monkeypatch, caplog):
    monkeypatch.setattr(launch, "ACTOR_START_TIMEOUT_S", 0.3)
    launcher = spread_launcher()
    fake_ray.kill_node("B")  # never noticed: the group still says CREATED
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="runtime.cluster.launch"), pytest.raises(ReplicaStartError) as e:
        launcher.launch(0)
    assert time.monotonic() - start < 5
    assert str(e.value) == (f"gave up waiting for the actors of replica 0 (placement group {name(0)}) to start: "
                            f"rank 1 not done within 0 s")
    assert f"for the actors of replica 0 (placement group {name(0)}) to start: rank 1 not done" in caplog.text
    assert name(0) not in fake_ray.held() and all(a.killed for a in fake_ray.actors)
    launcher.shutdown()


def test_a_shutdown_gives_a_waiting_placement_up(fake_ray):
    launcher = spread_launcher()
    fake_ray.kill_node("B")
    fake_ray.notice("B")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(launcher.launch, 1)
        while 1 not in launcher.waiting:
            time.sleep(0.01)
        launcher.shutdown()
        with pytest.raises(EngineUnavailableError, match="given up: shutting down"):
            waiting.result(timeout=5)
    assert fake_ray.held() == {}


class WaitingLauncher(FakeLauncher):
    """A launcher whose placement keeps waiting for resources (and says for what) until `placeable`."""

    def __init__(self) -> None:
        super().__init__(None)
        self.waiting: dict[int, str] = {}
        self.attempts = 0

    def launch(self, g: int, generation: int = 0) -> Any:
        self.attempts += 1
        if self.scheduler is None:
            self.waiting[g] = f"2 x {{'CPU': 1.0}} (spread) for replica-{g}, free now {{'CPU': 0.0}}"
            raise EngineUnavailableError(f"cannot place replica-{g} within 0 s")
        self.waiting.pop(g, None)
        return super().launch(g, generation)


def test_health_says_what_a_relaunch_waits_for(monkeypatch, caplog):
    monkeypatch.setattr(replica_health, "RELAUNCH_BACKOFF_S", (0.01, 0.02))
    client = fake_client(ServerArgs(dp_size=2), [FakeScheduler(), FakeScheduler()], None, health_interval_s=0.02)
    client.launcher = launcher = WaitingLauncher()
    try:
        with caplog.at_level(logging.WARNING, logger="runtime.cluster.replica_health"):
            for g in client.groups:
                g.schedulers[0].dead = True
            deadline = time.monotonic() + 10
            while client.health().healthy or "replica 1" not in (client.health().reason or "") or \
                    launcher.attempts < 8:  # retried, with backoff
                assert time.monotonic() < deadline, client.health()
                time.sleep(0.01)
            reason = client.health().reason
            for g in range(2):
                assert (f"replica {g} is down: RuntimeError: ActorDiedError: replica {g} died (relaunching; "
                        f"waiting for resources: 2 x {{'CPU': 1.0}} (spread) for replica-{g}, free now "
                        f"{{'CPU': 0.0}})") in reason
            failed = [r for r in caplog.records if "relaunch of replica" in r.getMessage()]
            assert failed and all(r.exc_info is None for r in failed)  # one line each, no traceback
            assert "cannot place replica-0 within 0 s; retrying in" in caplog.text
        launcher.scheduler = FakeScheduler  # the node is back
        client.wait_until_healthy(timeout_s=10)
        assert client.health().healthy and launcher.waiting == {}
    finally:
        client.shutdown()


def test_a_followers_death_is_no_failure_while_the_group_stops(monkeypatch):
    """SchedulerActor._watch awaits the followers' loops on the actor's loop (no blocking ray.get); a follower
    that dies fails the replica, naming the rank, unless stop() came first (a shutdown kills the ranks in no
    particular order)."""
    monkeypatch.setattr(scheduler_actor, "setup_logging", lambda level: None)  # it would stop log propagation

    async def follower_dies(stop_first: bool) -> tuple[list[str], bool]:
        actor = scheduler_actor.SchedulerActor(ServerArgs(), "m", RankSpec(0, 3))
        actor.name, actor.host = "replica 1", SimpleNamespace(is_running=lambda: True)
        failures: list[str] = []
        actor.group = SimpleNamespace(fail=failures.append)
        loops = [asyncio.get_running_loop().create_future() for _ in range(2)]
        watcher = asyncio.ensure_future(actor._watch(loops))
        if stop_first:
            await actor.stop()
        loops[1].set_exception(RuntimeError("ActorDiedError: killed"))
        await watcher
        return failures, loops[0].cancelled()

    assert asyncio.run(follower_dies(False)) == (["TP worker rank 2 of replica 1 failed: RuntimeError: "
                                                  "ActorDiedError: killed"], True)
    assert asyncio.run(follower_dies(True)) == ([], True)
