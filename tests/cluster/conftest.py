"""A Ray cluster shared by the tests/cluster modules (a Ray start costs seconds on 2 cores), plus small
helpers to run requests through an EngineClient. The multi-node module shuts it down to start its own
Cluster; the next module that asks for `ray_local` starts the local one again."""

from __future__ import annotations

import asyncio
import os

import pytest

from runtime.messages import GenerateRequest, RequestOutput
from runtime.sampling.params import SamplingParams

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind 127.0.0.1 (NOTES.md)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def start_local_ray() -> None:
    import ray

    if not ray.is_initialized():
        # Logical CPUs beyond the 2 cores: a replica's bundle is a slot, and a test's teardown may still be
        # releasing the previous one's while the next launches.
        ray.init(num_cpus=8, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}})


@pytest.fixture(scope="session")
def ray_session():
    import ray

    start_local_ray()
    yield
    ray.shutdown()


@pytest.fixture
def ray_local(ray_session):
    start_local_ray()  # again if the multi-node module took the cluster down


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
