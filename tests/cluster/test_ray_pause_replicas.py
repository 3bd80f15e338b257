"""Pause and weight updates over several replicas, on the Ray path without Ray (the real RayEngineClient over the
fake scheduler actors of tests/fake_ray_actors.py): a weight update that one replica refuses (it holds a request
paused in place and the update would flush) is refused on every replica before any loads, a 400 naming the
replica and why (a trainer's broadcast update closes its group on all of them instead); a replica relaunched
while the cluster is paused is paused in the cluster's mode before it takes requests, and a continue sent while
it comes back reaches it; /health_generate answers 200 without a probe while the replicas say they are paused."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from fake_ray_actors import FakeScheduler, actor_method, fake_client

from runtime.admin_messages import AdminReply, DistributedWeights, PauseControl, UpdateProbe, WeightUpdate
from runtime.cluster.ray_engine_client import RayEngineClient
from runtime.config import ServerArgs
from runtime.messages import SchedulerStats

ARGS = ServerArgs(dp_size=2, disable_request_link=True)
STALE = ("1 requests paused in place hold KV computed with the current weights, which a flush cannot drop: pause "
         "with mode retract or abort, or pass flush_cache=false to keep that KV (it goes stale) and the prefix cache")


class PausingScheduler(FakeScheduler):
    """Answers the pause, continue and weight-update calls as a SchedulerActor would, recording each."""

    def __init__(self, refuse: str | None = None, on_pause: Callable[[PausingScheduler], None] | None = None,
                 release: threading.Event | None = None):
        self.refuse, self.on_pause, self.release = refuse, on_pause, release  # release: a pause answers once set
        self.calls: list[str] = []
        self.paused: str | None = None
        self.probes: list[UpdateProbe] = []

    @actor_method
    async def check_update(self, probe: UpdateProbe) -> AdminReply:
        self.calls.append("check")
        self.probes.append(probe)
        return AdminReply(error=self.refuse if probe.flush_cache and not probe.abort_all_requests else None)

    @actor_method
    async def update_weights_from_disk(self, update: WeightUpdate) -> AdminReply:
        self.calls.append("load")
        return AdminReply(message=f"Weights updated from {update.model_path}.", weight_version="v2")

    @actor_method
    async def weight_sync(self, method: str, arg: object) -> AdminReply:
        self.calls.append(method)
        return AdminReply()

    @actor_method
    async def pause_generation(self, ctl: PauseControl) -> AdminReply:
        if self.on_pause is not None:
            self.on_pause(self)
        while self.release is not None and not self.release.is_set():
            await asyncio.sleep(0.005)
        self.paused = ctl.mode
        self.calls.append(ctl.mode)
        return AdminReply(message=f"paused ({ctl.mode})")

    @actor_method
    async def continue_generation(self) -> AdminReply:
        self.paused = None
        self.calls.append("continue")
        return AdminReply(message="continued")

    @actor_method
    async def stats(self) -> SchedulerStats:
        self.check_alive()
        return SchedulerStats(paused_replicas=int(self.paused is not None))


def _schedulers(client: RayEngineClient) -> list[PausingScheduler]:
    return [s for g in client.groups for s in g.schedulers]


def test_an_update_one_replica_refuses_is_refused_on_all_before_any_loads():
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    first, second = PausingScheduler(), PausingScheduler(refuse=STALE)
    client = fake_client(ARGS, [first, second], None)

    async def http_update() -> tuple[int, dict]:
        async with TestClient(TestServer(build_app(client, ARGS))) as http:
            r = await http.post("/update_weights_from_disk", json={"model_path": "/ckpt/b"})
            return r.status, await r.json()

    try:
        status, body = asyncio.run(http_update())
        assert status == 400 and body["success"] is False
        assert body["message"] == f"weight update refused on every replica, none loaded it; replica 1: {STALE}"
        assert first.calls == second.calls == ["check"] and client.model_path is None  # nobody loaded
        sync = DistributedWeights(names=["model.norm.weight"], dtypes=["float32"], shapes=[[64]], group_name="g")
        reply = asyncio.run(client.sync_weights(sync))  # the broadcast has nobody to receive it: the group closes
        assert reply.error.startswith("weight update refused on every replica") and "'g' was closed" in reply.error
        assert first.calls[1:] == second.calls[1:] == ["check", "destroy_weights_update_group"]
        for update in (WeightUpdate(model_path="/ckpt/b", flush_cache=False),  # what the refusal suggests
                       WeightUpdate(model_path="/ckpt/b", abort_all_requests=True)):  # the paused requests end
            assert asyncio.run(client.update_weights(update)).error is None
        assert first.calls[3:] == second.calls[3:] == ["check", "load"] * 2 and client.model_path == "/ckpt/b"
        assert second.probes[-2:] == [UpdateProbe(flush_cache=False), UpdateProbe(abort_all_requests=True)]
    finally:
        client.shutdown()


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_replica_relaunched_while_paused_comes_back_paused():
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    made: list[PausingScheduler] = []
    live_when_paused: list[bool] = []
    client = fake_client(ARGS, [PausingScheduler(), PausingScheduler()], lambda: made.append(PausingScheduler(
        on_pause=lambda s: live_when_paused.append(client.replicas[1].alive))) or made[-1], health_interval_s=0.02)

    async def health_generate() -> tuple[int, dict]:
        async with TestClient(TestServer(build_app(client, ARGS))) as http:
            r = await http.get("/health_generate")
            return r.status, await r.json()

    try:
        assert asyncio.run(client.pause_steps(PauseControl(mode="in_place"))).error is None
        client.groups[1].schedulers[0].dead = True  # its health check fails: relaunched
        _wait(lambda: client.restarts == 1 and client.replicas[1].alive, "the replica never came back")
        assert made[0].calls == ["in_place"] and live_when_paused == [False]  # paused before it took requests
        status, body = asyncio.run(health_generate())  # a probe would wait for the continue (the fakes take none)
        assert status == 200 and body["generation"] == "paused" and "on 2 schedulers" in body["message"]
        assert asyncio.run(client.continue_steps()).error is None
        assert [s.calls[-1] for s in _schedulers(client)] == ["continue", "continue"]
        assert asyncio.run(client.stats()).paused_replicas == 0
    finally:
        client.shutdown()


def test_a_continue_sent_while_the_relaunched_replica_pauses_reaches_it():
    pausing, release = threading.Event(), threading.Event()
    made: list[PausingScheduler] = []
    client = fake_client(ARGS, [PausingScheduler(), PausingScheduler()], lambda: made.append(PausingScheduler(
        on_pause=lambda s: pausing.set(), release=release)) or made[-1], health_interval_s=0.02)
    try:
        assert asyncio.run(client.pause_steps(PauseControl(mode="retract"))).error is None
        client.groups[1].schedulers[0].dead = True
        assert pausing.wait(10)
        assert asyncio.run(client.continue_steps()).error is None  # only replica 0 is live: it skips replica 1
        assert not client.replicas[1].alive and _schedulers(client)[0].calls == ["retract", "continue"]
        release.set()  # the relaunched replica's pause answers now, after the continue passed it by
        _wait(lambda: made[0].calls == ["retract", "continue"], "the continue never reached the relaunched replica")
        _wait(lambda: client.replicas[1].alive, "the relaunched replica never went live")
        assert made[0].paused is None and asyncio.run(client.stats()).paused_replicas == 0
    finally:
        client.shutdown()
