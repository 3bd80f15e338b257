"""LoRA loads and unloads on the Ray path without Ray: the real RayEngineClient over fake scheduler actors
(tests/fake_ray_actors.py), each holding a real LoraRegistry. A load reaches every replica
or none (undone where it had succeeded); an unload of an unknown name is a LoraNotFoundError; a relaunched
replica is brought from --lora-modules to the adapters served now. And the actors' own side: the scheduler
actor answers typed LoraUpdates, and a TP follower's refusal names its rank."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from fake_ray_actors import FakeScheduler, actor_method, fake_client

from runtime.cluster.ray_engine_client import RayEngineClient
from runtime.cluster.scheduler_actor import SchedulerActor, _lora_update
from runtime.cluster.tp_worker_actor import TpWorkerActor
from runtime.config import ServerArgs
from runtime.errors import InvalidRequestError
from runtime.lora.lora_config import LoraNotFoundError
from runtime.lora.lora_registry import LoraRegistry
from runtime.messages import LoraLoad, LoraUpdate

ARGS = ServerArgs(dp_size=2, enable_lora=True, lora_modules="start=/a/start", disable_request_link=True)


class LoraScheduler(FakeScheduler):
    """A scheduler actor's LoRA side: its registry, and a worker that refuses the paths in `refuse`."""

    def __init__(self, refuse: frozenset[str] = frozenset()):
        self.registry, self.refuse = LoraRegistry(ARGS), refuse

    def _add(self, load: LoraLoad) -> None:
        if load.path in self.refuse:
            raise InvalidRequestError(f"adapter {load.name!r} ({load.path}): no such folder", param="lora_path")

    @actor_method
    async def load_lora_adapter(self, name: str, path: str, replace: bool) -> LoraUpdate:
        return _lora_update(lambda: self.registry.load(name, path, self._add, replace))

    @actor_method
    async def unload_lora_adapter(self, name: str) -> LoraUpdate:
        return _lora_update(lambda: self.registry.unload(name))


@pytest.fixture
def client():
    c = fake_client(ARGS, [LoraScheduler(), LoraScheduler(frozenset({"/bad/on/one"}))], LoraScheduler,
                    health_interval_s=0.05)
    yield c
    c.shutdown()


def _served(c: RayEngineClient) -> list[dict[str, str]]:
    return [g.schedulers[0].registry.served() for g in c.groups]


def test_loads_and_unloads_reach_every_replica_or_none(client):
    async def scenario() -> None:
        await client.add_lora("x", "/a/x")
        assert client.lora_adapters() == {"start": "/a/start", "x": "/a/x"} and all(
            s == client.lora_adapters() for s in _served(client))
        with pytest.raises(InvalidRequestError, match="already been loaded"):
            await client.add_lora("x", "/a/y")
        with pytest.raises(InvalidRequestError, match="no such folder") as e:  # replica 1 refuses: undone on 0
            await client.add_lora("y", "/bad/on/one")
        assert e.value.param == "lora_path" and all("y" not in s for s in _served(client))
        await client.remove_lora("start")
        with pytest.raises(LoraNotFoundError):
            await client.remove_lora("start")
        assert all(s == {"x": "/a/x"} for s in _served(client))

    asyncio.run(scenario())
    client.groups[1].kill()  # the health loop notices, relaunches from --lora-modules, then restores
    deadline = time.monotonic() + 20
    while client.restarts < 1 or not all(r.alive for r in client.replicas):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert _served(client) == [{"x": "/a/x"}, {"x": "/a/x"}]


def test_actor_side_answers_and_follower_refusal():
    actor = SchedulerActor(ARGS, "/m", SimpleNamespace(rank=0))
    registry = LoraRegistry(ARGS)
    actor.host = SimpleNamespace(scheduler=SimpleNamespace(lora_ids=registry))
    loaded = []
    actor.rank = SimpleNamespace(worker=SimpleNamespace(add_lora=loaded.append))

    async def scenario() -> tuple[LoraUpdate, ...]:
        return (await actor.load_lora_adapter("a", "/p/a"), await actor.load_lora_adapter("a", "/p/b"),
                await actor.unload_lora_adapter("nope"), await actor.unload_lora_adapter("a"))

    ok, dup, missing, gone = asyncio.run(scenario())
    assert ok == LoraUpdate() and gone == LoraUpdate() and [x.path for x in loaded] == ["/p/a"]
    assert "already been loaded" in dup.error and not dup.not_found
    assert missing.not_found and "cannot be found" in missing.error

    def refuse(load: LoraLoad) -> None:
        raise InvalidRequestError("rank 16 is above --max-lora-rank 8", param="lora_path")

    follower = TpWorkerActor(ARGS, "/m", SimpleNamespace(rank=1))
    follower.rank = SimpleNamespace(worker=SimpleNamespace(add_lora=refuse))
    assert follower.add_lora(LoraLoad(lora_id=5, name="b", path="/p/b")).error == (
        "TP rank 1: rank 16 is above --max-lora-rank 8")
