"""Helpers shared by the tests/cluster modules: start the local Ray cluster, run requests through an
EngineClient. A module of its own (not conftest) so imports never pick up another folder's conftest."""

from __future__ import annotations

import asyncio
import os

from runtime.messages import GenerateRequest, RequestOutput
from runtime.sampling.params import SamplingParams

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray binds loopback only with this set
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def start_local_ray() -> None:
    import ray

    if not ray.is_initialized():
        # Logical CPUs beyond the 2 cores: a replica's bundle is a slot, and a test's teardown may still be
        # releasing the previous one's while the next launches.
        ray.init(address="local", num_cpus=8, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}})


def greedy(max_new_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kw)


async def collect(client, req: GenerateRequest) -> tuple[list[int], RequestOutput]:
    ids: list[int] = []
    last = None
    async for out in client.stream(client.validate(req)):
        ids.extend(out.new_token_ids)
        last = out
    return ids, last


def run_all(client, reqs: list[GenerateRequest]) -> list[tuple[list[int], RequestOutput]]:
    async def main():
        return await asyncio.gather(*(collect(client, r) for r in reqs))

    return asyncio.run(main())


def wait_healthy(url: str, timeout_s: float = 120, alive=lambda: True, why=lambda: "") -> None:
    """Polls url/health until a 200 (a gateway on Ray answers 503 while its replicas load);
    fails after timeout_s or once alive() says the server process is gone, with why() in the message."""
    import time

    import requests

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        assert alive() and time.monotonic() < deadline, f"{url} never answered /health: {why()}"
        time.sleep(0.5)
