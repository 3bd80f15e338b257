"""A replica relaunch after a node is lost, without Ray: FakeRay stands in for Ray's placement and actors as far
as ReplicaLauncher uses them. Two TP=2 replicas spread over two nodes; the second node dies. Its actors hang
until Ray notices the node is gone, and then Ray keeps each group's surviving bundle, so between them the two
groups hold the whole node left and neither could come back. A relaunch's wait ends once its group lost
bundles (or its actors did not start in time); the group is released, a fresh one is reserved, one replica
comes back on the node left and the other waits holding nothing, saying what it waits for, until the node
returns. The client's /health reason carries that wait, and a relaunch keeps retrying without a traceback.
A follower's death seen while the group is being stopped is not logged as a failure.

What must not end a start: a slow load (no limit; its progress is logged at INFO), one failed query of the group's
state (a GCS hiccup), actors that are slow to start in a group that is still whole (the group is kept). What must
not leak: a placement whose wait fails. A shutdown stops every replica at once, not one after another."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from fake_placement_ray import FakeActor, FakePG, FakeRay
from fake_ray_actors import FakeLauncher, FakeScheduler, fake_client

from runtime.cluster import placement, replica_group, replica_health, replica_start, scheduler_actor
from runtime.cluster.launch import ReplicaLauncher, replica_group_name
from runtime.cluster.replica_start import ReplicaStartError
from runtime.cluster.tp_rank import RankSpec
from runtime.config import ServerArgs
from runtime.errors import EngineUnavailableError


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


def test_actors_that_never_start_time_out_and_keep_their_whole_group(fake_ray, monkeypatch, caplog):
    monkeypatch.setattr(replica_start, "ACTOR_START_TIMEOUT_S", 0.3)
    launcher = spread_launcher()
    fake_ray.kill_node("B")  # never noticed: the group still says CREATED
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="runtime.cluster.replica_start"), \
            pytest.raises(ReplicaStartError) as e:
        launcher.launch(0)
    assert time.monotonic() - start < 5
    assert str(e.value) == (f"gave up waiting for the actors of replica 0 (placement group {name(0)}) to start: "
                            f"rank 1 not done within 0 s")
    assert f"for the actors of replica 0 (placement group {name(0)}) to start: rank 1 not done" in caplog.text
    # Whole as far as Ray knows: kept for the next try (a release would only queue it behind other jobs).
    assert fake_ray.held()[name(0)] == ["A", "B"] and all(a.killed for a in fake_ray.actors)
    fake_ray.notice("B")  # now it lost a bundle: the next try replaces it
    with pytest.raises(EngineUnavailableError, match=f"cannot place {name(0)} within 0 s"):
        launcher.launch(0)
    assert name(0) not in fake_ray.held()
    launcher.shutdown()


def test_a_placement_whose_wait_fails_is_removed(fake_ray, monkeypatch):
    import ray

    launcher = spread_launcher()
    launcher.placements.release(1)
    fake_ray.kill_node("B")
    fake_ray.notice("B")  # replica 1 cannot be placed now: its new group waits
    monkeypatch.setattr(ray, "available_resources", lambda: (_ for _ in ()).throw(ConnectionError("GCS unavailable")))
    with pytest.raises(ConnectionError):
        launcher.launch(1)
    fake_ray.revive("B")  # a group left behind would now take B
    assert name(1) not in fake_ray.held()
    launcher.shutdown()
    assert fake_ray.held() == {}


def slow_init(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every rank's load answers only `seconds` from now."""
    answer, ends = FakeActor.answer, time.monotonic() + seconds
    monkeypatch.setattr(FakeActor, "answer", lambda self, method, args: (False, None) if method == "init" and
                        time.monotonic() < ends else answer(self, method, args))


def flaky_state(monkeypatch: pytest.MonkeyPatch, fails: Any) -> None:
    """placement_group_table raises (a GCS RPC timeout) on the calls for which fails(n) says so."""
    ray_pg = importlib.import_module("ray.util.placement_group")
    table, calls = ray_pg.placement_group_table, itertools.count(1)

    def query(pg: FakePG) -> dict:
        if fails(next(calls)):
            raise TimeoutError("GCS rpc timed out")
        return table(pg)
    monkeypatch.setattr(ray_pg, "placement_group_table", query)


def test_a_slow_load_with_a_failed_state_query_goes_on(fake_ray, monkeypatch, caplog):
    monkeypatch.setattr(replica_start, "LOAD_LOG_S", 0.05)
    launcher = spread_launcher()
    flaky_state(monkeypatch, lambda n: n == 3)  # once, while the load waits
    slow_init(monkeypatch, 0.4)
    with caplog.at_level(logging.INFO, logger="runtime.cluster.replica_start"):
        group = launcher.launch(0)
    assert group.node_ids() == ["A", "B"] and fake_ray.held()[name(0)] == ["A", "B"]
    progress = [r for r in caplog.records if "for the ranks of replica 0" in r.getMessage()]
    assert progress and {r.levelno for r in progress} == {logging.INFO}, caplog.text  # no warning: no limit
    launcher.shutdown()


def test_a_state_that_stays_unreadable_gives_the_group_up(fake_ray, monkeypatch):
    monkeypatch.setattr(placement, "STATE_GRACE_S", 0.2)
    launcher = spread_launcher()
    flaky_state(monkeypatch, lambda n: True)
    slow_init(monkeypatch, 60)
    start = time.monotonic()
    with pytest.raises(ReplicaStartError, match=rf"the state of its placement group {name(0)} cannot be read "
                       r"\(TimeoutError: GCS rpc timed out; failing for 0 s\) \(rank 0, rank 1 not done\)"):
        launcher.launch(0)
    assert 0.2 <= time.monotonic() - start < 5 and name(0) not in fake_ray.held()
    fake_ray.up = False  # Ray shut down: no grace
    start = time.monotonic()
    with pytest.raises(ReplicaStartError, match="cannot be read: Ray is shut down"):
        launcher.launch(1)
    assert time.monotonic() - start < 0.2
    launcher.shutdown()


def test_a_shutdown_stops_every_replica_at_once(fake_ray, monkeypatch):
    monkeypatch.setattr(replica_group, "STOP_WAIT_S", 0.3)
    groups = spread_launcher().launch_all()
    fake_ray.kill_node("A")  # both schedulers (rank 0) are there: their stop() hangs
    start = time.monotonic()
    replica_group.kill_all(groups)
    assert 0.3 <= time.monotonic() - start < 0.55  # one wait for both, not one each
    assert all(a.killed for a in fake_ray.actors)


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
