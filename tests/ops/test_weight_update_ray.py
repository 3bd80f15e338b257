"""Live weight updates on the Ray path without Ray (the fake-actor pattern of tests/ops/test_admin_ray.py): the real
RayEngineClient sends the WeightUpdate to every replica and names one that failed; the scheduler actor has
every TP rank check the checkpoint before any rank loads (a follower that cannot take it leaves all ranks on
the old weights), and fails the group when a follower fails after rank 0 loaded; a follower's errors carry
its rank."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fake_ray_actors import FakeScheduler, actor_method, fake_client

from runtime.admin_messages import AdminReply, WeightUpdate
from runtime.cluster.ray_engine_client import RayEngineClient
from runtime.cluster.scheduler_actor import SchedulerActor
from runtime.cluster.tp_worker_actor import TpWorkerActor
from runtime.config import ServerArgs
from runtime.errors import EngineUnavailableError

ARGS = ServerArgs(dp_size=2, disable_request_link=True)
UPDATE = WeightUpdate(model_path="/ckpt/step-7", weight_version="step-7")


class WeightScheduler(FakeScheduler):
    def __init__(self, error: str | None = None):
        self.error, self.updates, self.version = error, [], "default"

    @actor_method
    async def update_weights_from_disk(self, update: WeightUpdate) -> AdminReply:
        self.updates.append(update)
        if self.error:
            return AdminReply(error=self.error)
        self.version = update.weight_version
        return AdminReply(message=f"Weights updated from {update.model_path} in 0.10 s.", num_paused_requests=2,
                          weight_version=self.version)

    @actor_method
    async def weight_version(self) -> str:
        return self.version


def _client(second: WeightScheduler) -> RayEngineClient:
    client = fake_client(ARGS, [WeightScheduler(), second], WeightScheduler)
    client.launcher.model_path = "/ckpt/start"  # as ReplicaLauncher: a relaunch loads this checkpoint
    return client


def test_every_replica_updates_and_a_failed_one_is_named():
    client = _client(WeightScheduler())
    try:
        reply = asyncio.run(client.update_weights(UPDATE))
        assert reply.error is None and reply.num_paused_requests == 4 and reply.weight_version == "step-7"
        assert reply.message == "Weights updated from /ckpt/step-7 in 0.10 s."  # the same line once
        assert client.model_path == "/ckpt/step-7" and asyncio.run(client.current_weight_version()) == "step-7"
        assert client.launcher.model_path == "/ckpt/step-7"  # a relaunched replica loads the new weights
        assert [s.updates for g in client.groups for s in g.schedulers] == [[UPDATE], [UPDATE]]
    finally:
        client.shutdown()
    client = _client(WeightScheduler(error="model_path '/ckpt/step-7' is not a checkpoint folder on this machine"))
    try:
        reply = asyncio.run(client.update_weights(UPDATE))
        assert reply.error.startswith("model_path") and client.model_path is None
        assert client.launcher.model_path == "/ckpt/start"
        assert asyncio.run(client.current_weight_version()) == "step-7, default"  # the replicas differ
    finally:
        client.shutdown()


class FakeRank:
    def __init__(self, name: str, calls: list, check: str | None = None, load: str | None = None):
        self.name, self.calls, self.check, self.load = name, calls, check, load

    def check_weights(self, update: WeightUpdate) -> AdminReply:
        self.calls.append(f"{self.name} check")
        return AdminReply(error=self.check)

    def update_weights(self, update: WeightUpdate, checked: bool = False) -> AdminReply:
        assert checked
        self.calls.append(f"{self.name} load")
        return AdminReply(error=self.load, message=f"{self.name} loaded")

    def bind_thread(self) -> None:
        pass


class FakeFollower:
    """A TpWorkerActor handle whose methods run the real actor's over a FakeRank."""

    def __init__(self, worker: FakeRank):
        self.actor = TpWorkerActor(ARGS, "/m", SimpleNamespace(rank=1))
        self.actor.rank = SimpleNamespace(worker=worker)
        self.check_weights = SimpleNamespace(remote=self.actor.check_weights)
        self.update_weights = SimpleNamespace(remote=self.actor.update_weights)


def _actor(rank0: FakeRank, follower: FakeRank, monkeypatch) -> tuple[SchedulerActor, list[str]]:
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)  # the fake handles answer at once
    actor = SchedulerActor(ARGS, "/m", SimpleNamespace(rank=0))
    actor.rank, actor._followers = SimpleNamespace(worker=rank0), [FakeFollower(follower)]
    failures: list[str] = []
    actor.group = SimpleNamespace(fail=failures.append)
    return actor, failures


@pytest.mark.parametrize("case", ["ok", "follower check fails", "rank 0 load fails", "follower load fails"])
def test_all_ranks_check_before_any_loads(case, monkeypatch):
    calls: list[str] = []
    rank0 = FakeRank("r0", calls, load="rolled back" if case == "rank 0 load fails" else None)
    follower = FakeRank("r1", calls, check="shape mismatch" if case == "follower check fails" else None,
                        load="disk error" if case == "follower load fails" else None)
    actor, failures = _actor(rank0, follower, monkeypatch)
    reply = actor._update_all_ranks(UPDATE)
    expected = {"ok": (["r0 check", "r1 check", "r0 load", "r1 load"], None),
                "follower check fails": (["r0 check", "r1 check"], "TP rank 1: shape mismatch"),
                "rank 0 load fails": (["r0 check", "r1 check", "r0 load"], "rolled back"),
                "follower load fails": (["r0 check", "r1 check", "r0 load", "r1 load"], "TP rank 1: disk error")}
    assert (calls, reply.error) == expected[case]
    assert bool(failures) == (case == "follower load fails")  # ranks out of step: the replica is relaunched


def test_scheduler_actor_runs_the_update_through_its_host(monkeypatch):
    actor = SchedulerActor(ARGS, "/m", SimpleNamespace(rank=0))
    seen = []

    def update_weights(apply, abort_all, flush, version):
        seen.append((abort_all, flush, version))
        return apply()

    actor.host = SimpleNamespace(update_weights=update_weights, weight_version="w3")
    monkeypatch.setattr(actor, "_update_all_ranks", lambda u: AdminReply(message=f"loaded {u.model_path}"))
    update = WeightUpdate(model_path="/ckpt/b", abort_all_requests=True, flush_cache=False, weight_version="w3")
    assert asyncio.run(actor.update_weights_from_disk(update)) == AdminReply(message="loaded /ckpt/b")
    assert seen == [(True, False, "w3")] and asyncio.run(actor.weight_version()) == "w3"

    def stopped(*a):
        raise EngineUnavailableError("the scheduler is not running")

    actor.host = SimpleNamespace(update_weights=stopped)
    assert asyncio.run(actor.update_weights_from_disk(update)) == AdminReply(error="the scheduler is not running")
