"""Fake scheduler actors behind the real RayEngineClient, so its logic (routing, failover, relaunch, admin
and LoRA fan-out) runs without Ray. A test subclasses FakeScheduler with the actor methods it exercises,
each marked @actor_method so the client calls it as a Ray handle's `.remote(...)`. A module of its own
(not conftest) so the test folders that use it share one copy; tests/ is on sys.path via tests/conftest.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from runtime.cluster.ray_engine_client import RayEngineClient
from runtime.config import ServerArgs
from runtime.messages import GenerateRequest, OutputPoll, RequestOutput, SchedulerStats, WorkerInfo

INFO = WorkerInfo(max_total_tokens=10000, max_reqs=64, context_len=1000, vocab_size=1000, eos_token_ids=[0],
                  attention_backend="fake", device="cpu")


class actor_method:  # lowercase: a decorator, like Ray's @ray.method
    """`actor.name.remote(*args)` schedules the coroutine and returns its future, as awaiting a Ray
    ObjectRef does."""

    def __init__(self, fn: Callable[..., Coroutine[Any, Any, Any]]):
        self.fn = fn

    def __get__(self, actor: object, owner: type | None = None) -> SimpleNamespace:
        return SimpleNamespace(remote=lambda *args: asyncio.ensure_future(self.fn(actor, *args)))


class FakeScheduler:
    """The calls of the client's pumps and health loop; once `dead`, each raises as a dead actor's would."""

    name = "replica"
    dead = False

    def check_alive(self) -> None:
        if self.dead:
            raise RuntimeError(f"ActorDiedError: {self.name} died")

    def step(self) -> list[RequestOutput]:
        """The outputs of one scheduler step (none unless a subclass generates some)."""
        return []

    @actor_method
    async def poll(self, consumer: str, timeout_s: float, cache_seq) -> bytes:
        await asyncio.sleep(0.01)  # a poll waits for the next step
        self.check_alive()
        return OutputPoll(outputs=self.step()).encode()

    @actor_method
    async def health(self) -> bool:
        self.check_alive()
        return True

    @actor_method
    async def stats(self) -> SchedulerStats:
        self.check_alive()
        return SchedulerStats()


@dataclass
class FakeGroup:
    """A ReplicaGroup of fake scheduler actors (no TP workers); killing it kills its schedulers."""

    index: int
    schedulers: list[FakeScheduler]
    generation: int = 0
    info: WorkerInfo = INFO
    workers: list = field(default_factory=list)

    def kill(self) -> None:
        for s in self.schedulers:
            s.dead = True


class FakeLauncher:
    """Relaunches replica g as a group of one scheduler from `scheduler()`; with None every relaunch
    fails."""

    def __init__(self, scheduler: Callable[[], FakeScheduler] | None):
        self.scheduler = scheduler
        self.waiting: dict[int, str] = {}  # ReplicaLauncher's: what a relaunch waits for, per replica

    def launch(self, g: int, generation: int = 0) -> FakeGroup:
        if self.scheduler is None:
            time.sleep(0.05)  # a launch that fails still takes a while: the client retries meanwhile
            raise RuntimeError("no resources")
        s = self.scheduler()
        s.name = f"replica {g} gen {generation}"
        return FakeGroup(g, [s], generation)

    def shutdown(self) -> None:
        pass


def fake_client(args: ServerArgs, schedulers: list[FakeScheduler],
                relaunch: Callable[[], FakeScheduler] | None, health_interval_s: float = 60) -> RayEngineClient:
    """The real client over one replica per scheduler; `relaunch()` makes a relaunched replica's scheduler."""
    for g, s in enumerate(schedulers):
        s.name = f"replica {g}"
    groups = [FakeGroup(g, [s]) for g, s in enumerate(schedulers)]
    return RayEngineClient(args, FakeLauncher(relaunch), groups, tokenizer=None, model_name="fake",
                           health_interval_s=health_interval_s)


async def consume(client: RayEngineClient, req: GenerateRequest, seen: dict[str, list[int]]) -> RequestOutput:
    """Streams req to its end through client, each delta's tokens appended to seen[rid]; its last output."""
    last = None
    async for out in client.stream(req):
        seen.setdefault(req.rid, []).extend(out.new_token_ids)
        last = out
    return last
