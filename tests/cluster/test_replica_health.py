"""RayEngineClient.health without Ray (fake scheduler actors, tests/fake_ray_actors.py): a replica whose
scheduler turns unhealthy (its answers say so, with the reason) is routed around and relaunched; GET /health
stays 200 ("degraded") while another replica serves, answers 503 {"status": "unhealthy", "reason"} naming each
down replica's reason once none can, and 200 again once a relaunched replica serves."""

from __future__ import annotations

import asyncio
import time

from fake_ray_actors import FakeScheduler, actor_method, fake_client

from runtime.config import ServerArgs
from runtime.engine_client import EngineHealth
from runtime.messages import OutputPoll


class SickScheduler(FakeScheduler):
    """Serves until `reason` is set, then answers unhealthy with it (as SchedulerActor does once its steps
    keep failing)."""

    reason: str | None = None

    @actor_method
    async def poll(self, consumer: str, timeout_s: float, cache_seq) -> bytes:
        await asyncio.sleep(0.01)
        self.check_alive()
        return OutputPoll(outputs=[], healthy=self.reason is None, error=self.reason).encode()

    @actor_method
    async def health(self) -> bool:
        self.check_alive()
        return self.reason is None

    @actor_method
    async def down_reason(self) -> str | None:
        return self.reason


def test_health_is_unhealthy_only_while_no_replica_can_serve():
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    client = fake_client(ServerArgs(dp_size=2), [SickScheduler(), SickScheduler()], None, health_interval_s=0.05)
    try:
        async def wait_alive(alive: list[bool]) -> None:
            deadline = time.monotonic() + 10
            while client.routing_stats().alive != alive:
                assert time.monotonic() < deadline, client.routing_stats()
                await asyncio.sleep(0.01)

        async def scenario() -> list[tuple[int, dict]]:
            seen = []
            async with TestClient(TestServer(build_app(client, ServerArgs(dp_size=2)))) as http:
                async def probe() -> None:
                    r = await http.get("/health")
                    seen.append((r.status, await r.json()))

                await probe()
                client.groups[0].schedulers[0].reason = "a scheduler step met a device error (CUDA error: boom)"
                await wait_alive([False, True])  # its relaunch keeps failing: no launcher yet
                assert client.health() == EngineHealth()
                await probe()
                client.groups[1].schedulers[0].reason = "3 scheduler steps failed in a row"
                await wait_alive([False, False])
                await probe()
                r = await http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
                seen.append((r.status, (await r.json())["error"]))  # a model route says why, not "starting"
                client.launcher.scheduler = SickScheduler  # the next relaunches work
                await wait_alive([True, True])
                await probe()
            return seen

        ok, degraded, down, refused, back = asyncio.run(scenario())
        assert ok == (200, {"status": "ok", "replicas_up": 2, "replicas": 2})
        assert degraded == (200, {"status": "degraded", "replicas_up": 1, "replicas": 2})
        assert down == (503, {"status": "unhealthy", "reason": (
            "no replica can serve: replica 0 failed: a scheduler step met a device error (CUDA error: boom) "
            "(relaunching); replica 1 failed: 3 scheduler steps failed in a row (relaunching)")})
        assert refused[0] == 503 and refused[1]["code"] == "engine_unhealthy", refused
        assert refused[1]["message"] == "the engine is unhealthy: " + down[1]["reason"], refused
        assert back == ok and client.health() == EngineHealth() and client.restarts == 2
    finally:
        client.shutdown()
