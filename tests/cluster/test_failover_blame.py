"""Whose failure moves a request (RayEngineClient without Ray: fake scheduler actors behind the real client, as
tests/fake_ray_actors.py). A request whose own step meets a fatal device error ends with that error and is not
moved: one bad request breaks one replica, not each in turn (it took every replica down, relaunch after relaunch,
before). A request the broken replica never ran (FinishReason code ENGINE_UNHEALTHY, as SchedulerActor and the
scheduler answer it) moves and finishes its undisturbed sequence, however many replicas such failures break while one
is left. Alike whether the answer carrying those ends still says healthy or already unhealthy (as SchedulerActor answers
now: a failed step's verdict, or the step watchdog's for a step that hangs, is published before the ends go out, and
readers wait for them). And moves are capped: a request that moved once per replica ends with the error."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest
from fake_ray_actors import FakeScheduler, actor_method, consume, fake_client

from runtime.cluster.ray_engine_client import RayEngineClient
from runtime.cluster.routing import ReplicaLoad, RoutingPolicy
from runtime.config import ServerArgs
from runtime.engine_client import ENGINE_UNHEALTHY
from runtime.messages import FinishReason, GenerateRequest, OutputPoll, RequestOutput
from runtime.sampling.params import SamplingParams

REASON = "a scheduler step met a device error no later step recovers from (RuntimeError: CUDA error: device-side assert)"
OWN = "internal error: RuntimeError: CUDA error: device-side assert triggered"


class FirstLive(RoutingPolicy):
    """Every request to the first live replica: which replica each lands on is known."""

    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int,
               hashes: Sequence[int] = ()) -> ReplicaLoad:
        return live[0]


def token(rid: str, position: int) -> int:
    return (sum(map(ord, rid)) * 31 + position * 7) % 997 + 1


class PoisonScheduler(FakeScheduler):
    """One token per request per poll, as SchedulerActor over a scheduler would answer, until a step holds a rid
    starting "poison" (after it streamed `poison_after` tokens here): then that step fails with a fatal device
    error. The poison ends with the step's own error (code None); the others end with ENGINE_UNHEALTHY, as
    requests that never ran in it; the answer carrying them says healthy, later ones not (the old order: a
    scheduler now publishes the verdict first, and the client must end the poison either way), and later
    submissions are refused with the code. With `dies`, the step kills the actor instead (a
    dead process: the client's calls raise). With `verdict_first`, the answer carrying them says unhealthy already.
    """

    broken: list[str] = []  # every replica a poison step broke, across relaunches (reset by each test)
    dies = False
    verdict_first = False
    poison_after = 2

    def __init__(self):
        self.reqs: dict[str, tuple[GenerateRequest, list[int]]] = {}
        self.out: list[RequestOutput] = []
        self.reason: str | None = None

    @actor_method
    async def submit(self, req: GenerateRequest, consumer: str) -> None:
        self.check_alive()
        if self.reason is not None:
            self.out.append(_ended(req.rid, FinishReason("error", message=self.reason, code=ENGINE_UNHEALTHY)))
        else:
            self.reqs[req.rid] = (req, list(req.resumed_output_ids))

    @actor_method
    async def abort(self, rid: str) -> None:
        self.reqs.pop(rid, None)

    @actor_method
    async def poll(self, consumer: str, timeout_s: float, cache_seq) -> bytes:
        await asyncio.sleep(0.01)
        self.check_alive()
        healthy = self.reason is None
        if healthy:
            self.step()
            if self.verdict_first:
                healthy = self.reason is None
        out, self.out = self.out, []
        return OutputPoll(outputs=out, healthy=healthy, error=None if healthy else self.reason).encode()

    def step(self) -> None:
        rid = next((r for r in self.reqs if r.startswith("poison")), None)
        poison = self.reqs.get(rid) if rid is not None else None
        if poison is not None and len(poison[1]) - len(poison[0].resumed_output_ids) >= self.poison_after:
            type(self).broken.append(self.name)
            if self.dies:
                self.dead = True
                return
            self.reason = REASON
            own = FinishReason("error", message=OWN)
            others = FinishReason("error", message=f"the engine is unhealthy: {REASON}", code=ENGINE_UNHEALTHY)
            self.out += [_ended(r, own if r == rid else others) for r in self.reqs]
            self.reqs.clear()
            return
        for rid, (req, ids) in list(self.reqs.items()):
            ids.append(token(rid, len(ids)))
            done = len(ids) >= req.sampling_params.max_new_tokens
            self.out.append(RequestOutput(rid=rid, new_token_ids=ids[-1:], finished=done,
                                          finish_reason=FinishReason("length") if done else None))
            if done:
                del self.reqs[rid]

    @actor_method
    async def health(self) -> bool:
        self.check_alive()
        return self.reason is None


def _ended(rid: str, reason: FinishReason) -> RequestOutput:
    return RequestOutput(rid=rid, new_token_ids=[], finished=True, finish_reason=reason)


def make_client(kind: type[PoisonScheduler], dp: int) -> RayEngineClient:
    kind.broken = []
    client = fake_client(ServerArgs(dp_size=dp), [kind() for _ in range(dp)], kind, health_interval_s=0.05)
    client.policy = FirstLive()
    return client


def request(rid: str, n: int = 30) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=n,
                                                                                          temperature=0.0))


def run_poison(client: RayEngineClient, with_bystander: bool) -> tuple[RequestOutput, RequestOutput | None, dict]:
    """Streams a bystander (when asked) and, once it is under way on the same replica, the poison request."""
    seen: dict[str, list[int]] = {}

    async def scenario():
        other = asyncio.create_task(consume(client, request("bystander"), seen)) if with_bystander else None
        while with_bystander and len(seen.get("bystander", [])) < 3:
            await asyncio.sleep(0.01)
        poison = await consume(client, request("poison", 400), seen)
        return poison, (await other if other is not None else None)

    poison, other = asyncio.run(scenario())
    return poison, other, seen


class VerdictFirst(PoisonScheduler):
    verdict_first = True


@pytest.mark.parametrize("kind", [PoisonScheduler, VerdictFirst])
def test_the_failing_request_ends_with_its_error_and_the_others_move(kind: type[PoisonScheduler]):
    client = make_client(kind, dp=3)
    try:
        poison, bystander, seen = run_poison(client, with_bystander=True)
        assert poison.finish_reason == FinishReason("error", message=OWN)  # its own error, not moved
        assert kind.broken == ["replica 0"]  # it broke one replica, not each in turn
        assert bystander.finish_reason.kind == "length"  # never ran in that step: moved, finished undisturbed
        assert seen["bystander"] == [token("bystander", k) for k in range(30)]
        assert client.failovers == 1 and client.failover_errors == 0
        client.wait_until_healthy(timeout_s=10)
        assert client.restarts == 1
    finally:
        client.shutdown()


class WithBystander(RoutingPolicy):
    """Everything goes where the bystander runs (else the first live replica)."""

    def __init__(self, streams: dict):
        self.streams = streams

    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int,
               hashes: Sequence[int] = ()) -> ReplicaLoad:
        st = self.streams.get("bystander")
        return next((r for r in live if st is not None and r.index == st.target), live[0])


def test_a_request_that_never_ran_in_a_failing_step_moves_again_while_a_replica_is_left():
    client = make_client(PoisonScheduler, dp=3)
    client.policy = WithBystander(client._streams)
    seen: dict[str, list[int]] = {}

    async def scenario():
        other = asyncio.create_task(consume(client, request("bystander", 200), seen))
        while len(seen.get("bystander", [])) < 3:
            await asyncio.sleep(0.01)
        p1 = await consume(client, request("poison-1", 400), seen)  # breaks the bystander's replica
        p2 = await consume(client, request("poison-2", 400), seen)  # the client's retry: breaks the next one
        return p1, p2, await other

    try:
        p1, p2, bystander = asyncio.run(scenario())
        assert p1.finish_reason == p2.finish_reason == FinishReason("error", message=OWN)  # each ends unmoved
        assert PoisonScheduler.broken == ["replica 0", "replica 1"]
        assert bystander.finish_reason.kind == "length"  # moved twice, innocent both times: it finishes
        assert seen["bystander"] == [token("bystander", k) for k in range(200)]
        # poison-2 may reach replica 0 before its client hears it is down: refused with the code, it moves too
        assert client.failovers >= 2 and client.failover_errors == 0
    finally:
        threading.Thread(target=client.shutdown, daemon=True).start()  # relaunches may be under way


class Killer(PoisonScheduler):
    dies = True
    poison_after = 10  # tokens streamed on a replica before it dies there: the one it broke is back meanwhile


def test_a_request_moved_once_per_replica_ends_with_the_error():
    client = make_client(Killer, dp=2)
    try:
        poison, _, seen = run_poison(client, with_bystander=False)
        assert poison.finish_reason.kind == "error"
        assert poison.finish_reason.message.endswith("; not moved again: it has moved 2 times already")
        assert len(Killer.broken) == 3 and client.failovers == 2 and client.failover_errors == 1
        assert seen["poison"] == [token("poison", k) for k in range(30)]  # what it streamed stays seamless
    finally:
        threading.Thread(target=client.shutdown, daemon=True).start()  # relaunches may be under way
