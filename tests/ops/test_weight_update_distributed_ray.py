"""Weights from a trainer's process group on the Ray path, without Ray (the fake actors of
tests/ops/test_weight_update_ray.py): the real RayEngineClient gives each routing target its own block of ranks
(target i's TP rank r joins at rank_offset + i * tp_size + r) and refuses a world_size with no room for them;
metadata nobody can receive by closes the group on every target; the real SchedulerActor has every TP rank
(the real TpWorkerActor over a fake worker for the follower) receive and check before any loads, all drop the
tensors when one rank's do not fit, and fails the replica when a follower fails to load after rank 0 did; a join
refused by one rank (or target) is undone on the others, and an update refused before receiving (asleep, the
scheduler stopped) closes the group on every rank."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fake_ray_actors import FakeScheduler, actor_method, fake_client

from runtime.admin_messages import AdminReply, DistributedWeights, WeightSyncInit
from runtime.cluster.scheduler_actor import SchedulerActor
from runtime.cluster.tp_worker_actor import TpWorkerActor
from runtime.config import ServerArgs
from runtime.errors import InvalidRequestError

ARGS = ServerArgs(dp_size=2, tp_size=2, disable_request_link=True)
INIT = WeightSyncInit(master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=5, group_name="g")
UPDATE = DistributedWeights(names=["model.norm.weight"], dtypes=["bfloat16"], shapes=[[64]], group_name="g",
                            weight_version="step-3")


class SyncScheduler(FakeScheduler):
    def __init__(self, refuse_join: str | None = None):
        self.calls: list[tuple[str, object]] = []
        self.refuse_join = refuse_join

    @actor_method
    async def weight_sync(self, method: str, arg: object) -> AdminReply:
        self.calls.append((method, arg))
        if method == "init_weights_update_group" and self.refuse_join:
            return AdminReply(error=self.refuse_join)
        return AdminReply(message=f"{method} done", weight_version="step-3" if "update" in method else "")


def test_client_gives_each_target_its_ranks_and_closes_on_bad_metadata():
    schedulers = [SyncScheduler(), SyncScheduler()]
    client = fake_client(ARGS, schedulers, None)
    try:
        reply = asyncio.run(client.join_weight_sync(INIT))
        assert reply.error is None and [s.calls[0][1].rank_offset for s in schedulers] == [1, 3]
        reply = asyncio.run(client.join_weight_sync(WeightSyncInit(**{**_fields(INIT), "world_size": 4})))
        assert "world_size 4 has no room for this server's 4 TP ranks" in reply.error
        with pytest.raises(InvalidRequestError, match="backend"):
            asyncio.run(client.join_weight_sync(WeightSyncInit(**{**_fields(INIT), "backend": "mpi"})))
        reply = asyncio.run(client.sync_weights(UPDATE))
        assert reply.error is None and reply.weight_version == "step-3"
        assert [s.calls[-1] for s in schedulers] == [("update_weights_from_distributed", UPDATE)] * 2
        bad = DistributedWeights(names=["a", "b"], dtypes=["float32"], shapes=[[1], [1]], group_name="g")
        with pytest.raises(InvalidRequestError, match="same length.*'g' was closed") as e:
            asyncio.run(client.sync_weights(bad))
        assert e.value.param == "names"
        assert [s.calls[-1] for s in schedulers] == [("destroy_weights_update_group", "g")] * 2
        client.replicas[1].alive = False  # its ranks could not join: the trainer's world_size would be wrong
        assert "routing targets [1] are down" in asyncio.run(client.join_weight_sync(INIT)).error
    finally:
        client.shutdown()


def test_a_join_refused_by_one_target_is_undone_on_the_others():
    schedulers = [SyncScheduler(), SyncScheduler(refuse_join="TP rank 1: could not join")]
    client = fake_client(ARGS, schedulers, None)
    try:
        reply = asyncio.run(client.join_weight_sync(INIT))
        assert reply.error == "TP rank 1: could not join; routing targets [0] left the group again"
        assert [m for m, _ in schedulers[0].calls] == ["init_weights_update_group", "destroy_weights_update_group"]
        assert [m for m, _ in schedulers[1].calls] == ["init_weights_update_group"]  # its own ranks left already
    finally:
        client.shutdown()


def _fields(s) -> dict:
    return {f: getattr(s, f) for f in s.__struct_fields__}


class FakeRank:
    """A TpWorker's broadcast-update calls, recorded."""

    def __init__(self, name: str, calls: list, check: str | None = None, load: str | None = None,
                 join: str | Exception | None = None):
        self.name, self.calls, self.check, self.load, self.join = name, calls, check, load, join
        self.sync_groups: dict[str, object] = {"g": object()}

    def init_weights_update_group(self, init: WeightSyncInit, local_rank: int = 0) -> AdminReply:
        self.calls.append(f"{self.name} join as {init.rank_offset + local_rank}")
        if isinstance(self.join, Exception):
            raise self.join
        return AdminReply(error=self.join, message="Succeeded to initialize custom process group.")

    def destroy_weights_update_group(self, group_name: str) -> AdminReply:
        self.calls.append(f"{self.name} leave")
        return AdminReply() if self.sync_groups.pop(group_name, None) else AdminReply(error="does not exist")

    def receive_weights(self, update: DistributedWeights) -> AdminReply:
        self.calls.append(f"{self.name} receive")
        return AdminReply(error=self.check)

    def load_received(self, _: object = None) -> AdminReply:
        self.calls.append(f"{self.name} load")
        return AdminReply(error=self.load, message="Updated 1 tensors in 0.01 s.")

    def drop_received(self, _: object = None) -> AdminReply:
        self.calls.append(f"{self.name} drop")
        return AdminReply()

    def bind_thread(self) -> None:
        pass


class FakeFollower:
    """A TpWorkerActor handle whose methods run the real actor's over a FakeRank (Ray's .remote answers at once
    here, so the follower's calls are recorded before rank 0's)."""

    def __init__(self, worker: FakeRank):
        actor = TpWorkerActor(ARGS, "/m", SimpleNamespace(rank=1))
        actor.rank = SimpleNamespace(worker=worker)
        for method in ("init_weights_update_group", "destroy_weights_update_group", "receive_weights",
                       "load_received", "drop_received"):
            setattr(self, method, SimpleNamespace(remote=getattr(actor, method)))


def _actor(rank0: FakeRank, follower: FakeRank, monkeypatch) -> tuple[SchedulerActor, list[str]]:
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    actor = SchedulerActor(ARGS, "/m", SimpleNamespace(rank=0))
    actor.rank, actor._followers = SimpleNamespace(worker=rank0), [FakeFollower(follower)]
    failures: list[str] = []
    actor.group = SimpleNamespace(fail=failures.append)
    actor.host = SimpleNamespace(update_weights=lambda apply, abort_all, flush, version: apply())
    return actor, failures


def test_every_rank_joins_at_its_rank(monkeypatch):
    calls: list[str] = []
    actor, _ = _actor(FakeRank("r0", calls), FakeRank("r1", calls), monkeypatch)
    reply = asyncio.run(actor.weight_sync("init_weights_update_group", INIT))
    assert reply.error is None and calls == ["r1 join as 2", "r0 join as 1"]


@pytest.mark.parametrize("case", ["ok", "follower's tensors do not fit", "follower load fails"])
def test_all_ranks_receive_and_check_before_any_loads(case, monkeypatch):
    calls: list[str] = []
    follower = FakeRank("r1", calls, check="no such parameter 'x'" if "fit" in case else None,
                        load="disk error" if "load" in case else None)
    actor, failures = _actor(FakeRank("r0", calls), follower, monkeypatch)
    reply = asyncio.run(actor.weight_sync("update_weights_from_distributed", UPDATE))
    expected = {"ok": (["r1 receive", "r0 receive", "r1 load", "r0 load"], None),
                "follower's tensors do not fit": (["r1 receive", "r0 receive", "r1 drop", "r0 drop"],
                                                  "TP rank 1: no such parameter 'x'"),
                "follower load fails": (["r1 receive", "r0 receive", "r1 load", "r0 load"], "TP rank 1: disk error")}
    assert (calls, reply.error) == expected[case]
    assert bool(failures) == (case == "follower load fails")  # ranks out of step: the replica is relaunched


@pytest.mark.parametrize("case", ["follower refuses", "rank 0 raises"])
def test_a_failed_join_leaves_no_rank_in_the_group(case, monkeypatch):
    calls: list[str] = []
    rank0 = FakeRank("r0", calls, join=RuntimeError("store timed out") if "raises" in case else None)
    actor, _ = _actor(rank0, FakeRank("r1", calls, join="outside world_size" if "refuses" in case else None),
                      monkeypatch)
    reply = asyncio.run(actor.weight_sync("init_weights_update_group", INIT))
    # a refusal means that rank holds nothing new; a rank whose call raised may have joined: it leaves too
    left, leaves = ("0", ["r0 leave"]) if "refuses" in case else ("0, 1", ["r1 leave", "r0 leave"])
    assert calls == ["r1 join as 2", "r0 join as 1", *leaves]
    error = "TP rank 1: outside world_size" if "refuses" in case else "TP rank 0: RuntimeError: store timed out"
    assert reply.error == f"{error}; the TP ranks that had joined ({left}) left the group again"


class RefusingHost:
    """SchedulerHost.update_weights refusing before apply() runs, as it does while the weights sleep (or raising,
    as when the scheduler stopped)."""

    def __init__(self, error: Exception | None = None):
        self.error = error

    def update_weights(self, apply, abort_all, flush, version) -> AdminReply:
        if self.error is not None:
            raise self.error
        return AdminReply(error="the weights are asleep (released by sleep / release_memory_occupation): wake_up "
                                "with tags weights before updating them")


@pytest.mark.parametrize("case", ["asleep", "scheduler stopped"])
def test_an_update_refused_before_receiving_closes_the_group_on_every_rank(case, monkeypatch):
    from runtime.errors import EngineUnavailableError

    calls: list[str] = []
    actor, _ = _actor(FakeRank("r0", calls), FakeRank("r1", calls), monkeypatch)
    actor.host = RefusingHost(EngineUnavailableError("scheduler stopped") if "stopped" in case else None)
    reply = asyncio.run(actor.weight_sync("update_weights_from_distributed", UPDATE))
    assert sorted(calls) == ["r0 leave", "r1 leave"]  # the trainer's broadcast ends instead of hanging
    assert (case if "stopped" in case else "weights are asleep") in reply.error and "'g' was closed" in reply.error


def test_an_update_of_a_group_rank_0_lacks_holds_no_request(monkeypatch):
    calls: list[str] = []
    rank0 = FakeRank("r0", calls)
    rank0.sync_groups = {}
    actor, _ = _actor(rank0, FakeRank("r1", calls), monkeypatch)
    actor.host = SimpleNamespace()  # no update_weights: holding requests would fail the test
    reply = asyncio.run(actor.weight_sync("update_weights_from_distributed", UPDATE))
    assert reply.error == "weight update group 'g' does not exist: init_weights_update_group first" and calls == []
