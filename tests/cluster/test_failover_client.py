"""RayEngineClient's failover logic without Ray: fake scheduler actors (tests/fake_ray_actors.py;
deterministic tokens, one per poll) behind the real client. A replica that dies mid-stream moves each of
its streams to the live one, resubmitted with exactly the tokens already streamed, so every stream ends
with the undisturbed sequence (none missing, none repeated); the dead replica is relaunched and gets
traffic again; the failovers are counted; with no replica left a stream ends with an error that says so."""

from __future__ import annotations

import asyncio
import threading
import time

from fake_ray_actors import FakeScheduler, actor_method, consume, fake_client

from runtime.cluster.ray_engine_client import RayEngineClient
from runtime.cluster.routing import create_routing_policy
from runtime.config import ServerArgs
from runtime.messages import FinishReason, GenerateRequest, RequestOutput
from runtime.sampling.params import SamplingParams


def token(prompt: list[int], position: int) -> int:
    return (sum(prompt) * 31 + position * 7) % 997 + 1


class TokenScheduler(FakeScheduler):
    """Generates token(prompt, position) per request per poll; once dead every call raises."""

    def __init__(self):
        self.submitted: list[GenerateRequest] = []
        self.reqs: dict[str, tuple[GenerateRequest, list[int]]] = {}

    @actor_method
    async def submit(self, req: GenerateRequest, consumer: str) -> None:
        self.check_alive()
        self.submitted.append(req)
        self.reqs[req.rid] = (req, list(req.resumed_output_ids))

    @actor_method
    async def abort(self, rid: str) -> None:
        self.reqs.pop(rid, None)

    def step(self) -> list[RequestOutput]:
        outs = []
        for rid, (req, ids) in list(self.reqs.items()):
            ids.append(token(req.input_ids, len(ids)))
            done = len(ids) >= req.sampling_params.max_new_tokens
            outs.append(RequestOutput(rid=rid, new_token_ids=ids[-1:], finished=done,
                                      finish_reason=FinishReason("length") if done else None,
                                      completion_tokens=len(ids)))
            if done:
                del self.reqs[rid]
        return outs


def make_client(fail_relaunch: bool = False) -> RayEngineClient:
    client = fake_client(ServerArgs(dp_size=2), [TokenScheduler(), TokenScheduler()],
                         None if fail_relaunch else TokenScheduler, health_interval_s=0.05)
    client.policy = create_routing_policy("round_robin")
    return client


def request(i: int, n: int = 40) -> GenerateRequest:
    return GenerateRequest(rid=f"r{i}", input_ids=[i, i + 1, i + 2],
                           sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0))


def test_streams_move_on_mid_stream_and_the_replica_comes_back():
    client = make_client()
    try:
        victim = client.groups[0].schedulers[0]
        seen: dict[str, list[int]] = {}

        async def scenario():
            tasks = [asyncio.create_task(consume(client, request(i), seen)) for i in range(8)]
            while min((len(seen.get(f"r{i}", [])) for i in range(8)), default=0) < 5:
                await asyncio.sleep(0.01)
            victim.dead = True  # mid-stream, every stream has tokens out already
            return await asyncio.gather(*tasks)

        lasts = asyncio.run(scenario())
        for i, last in enumerate(lasts):
            req = request(i)
            assert last.finish_reason.kind == "length", last
            assert seen[req.rid] == [token(req.input_ids, k) for k in range(40)]
        moved = [r for r in client.groups[1].schedulers[0].submitted if r.resumed_output_ids]
        assert len(moved) == 4 and client.failovers == 4 and client.failover_errors == 0
        for r in moved:  # resubmitted with exactly what had been streamed: no gap, no repeat
            assert r.resumed_output_ids == [token(r.input_ids, k) for k in range(len(r.resumed_output_ids))]
            assert 5 <= len(r.resumed_output_ids) < 40
        client.wait_until_healthy(timeout_s=10)
        assert client.restarts == 1 and client.groups[0].generation == 1
        seen.clear()

        async def after():
            return await asyncio.gather(*(consume(client, request(100 + i, 3), seen) for i in range(4)))

        assert all(o.finish_reason.kind == "length" for o in asyncio.run(after()))
        assert len(client.groups[0].schedulers[0].submitted) == 2  # the relaunched replica serves again
        stats = client.routing_stats()
        assert stats.failovers == 4 and stats.restarts == 1 and stats.inflight == [0, 0]
    finally:
        client.shutdown()


def test_no_live_replica_ends_the_stream_with_a_clear_error():
    client = make_client(fail_relaunch=True)
    try:
        seen: dict[str, list[int]] = {}

        async def scenario():
            task = asyncio.create_task(consume(client, request(0, 400), seen))
            while len(seen.get("r0", [])) < 3:
                await asyncio.sleep(0.01)
            for g in client.groups:
                g.schedulers[0].dead = True
            return await task

        last = asyncio.run(scenario())
        assert last.finish_reason.kind == "error"
        assert "no healthy replica is left" in last.finish_reason.message
        assert client.failover_errors == 1 and not client.is_ready()
    finally:
        threading.Thread(target=client.shutdown, daemon=True).start()  # relaunches keep failing: don't wait


def test_health_and_metrics_say_a_replica_is_down():
    """While one replica is down (its relaunch failing), /health stays 200 — the other one serves — but
    says "degraded" with the count, and /metrics' shoal:replica_up shows which."""
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    client = make_client(fail_relaunch=True)
    try:
        async def probe() -> tuple[dict, dict, str]:
            async with TestClient(TestServer(build_app(client, ServerArgs(dp_size=2)))) as http:
                before = await (await http.get("/health")).json()
                client.groups[0].schedulers[0].dead = True
                deadline = time.monotonic() + 10
                while client.routing_stats().alive != [False, True]:
                    assert time.monotonic() < deadline, client.routing_stats()
                    await asyncio.sleep(0.02)
                resp = await http.get("/health")
                assert resp.status == 200
                return before, await resp.json(), await (await http.get("/metrics")).text()

        before, after, metrics = asyncio.run(probe())
        assert before == {"status": "ok", "replicas_up": 2, "replicas": 2}
        assert after == {"status": "degraded", "replicas_up": 1, "replicas": 2}
        assert 'shoal:replica_up{replica="0"} 0.0' in metrics and 'shoal:replica_up{replica="1"} 1.0' in metrics
    finally:
        threading.Thread(target=client.shutdown, daemon=True).start()  # relaunches keep failing: don't wait
