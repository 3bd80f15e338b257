"""A TP rank whose step raises: the replica's requests end at once with an error that names the rank
and its own exception (not only Ray's wrapper line), the replica reports unhealthy, and the client
relaunches it; the relaunched replica serves."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray_helpers import collect, greedy

from runtime.config import ServerArgs
from runtime.messages import GenerateRequest

pytestmark = pytest.mark.ray


def test_follower_exception_is_named_and_the_replica_recovers(ray_local, tiny_llama):
    from runtime.cluster.launch import create_ray_engine_client

    client = create_ray_engine_client(ServerArgs(model_path=str(tiny_llama), tp_size=2, device="cpu",
                                                 max_total_tokens=2048))
    try:
        import ray

        follower = client.groups[0].workers[1]
        ray.get(follower.inject_fault.remote(2, "CUDA error: an illegal memory access was encountered\nsecond line"))
        ids, last = asyncio.run(collect(client, GenerateRequest(rid="doomed", input_ids=[5, 6, 7],
                                                                 sampling_params=greedy(50, ignore_eos=True))))
        assert last.finished and last.finish_reason.kind == "error", last
        msg = last.finish_reason.message
        assert "TP worker rank 1 of replica 0 failed" in msg, msg
        assert "RuntimeError: CUDA error: an illegal memory access was encountered" in msg
        assert "second line" not in msg and len(ids) < 50
        deadline = time.monotonic() + 90  # the client notices at its next poll, then relaunches
        while client.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.restarts == 1
        client.wait_until_healthy(timeout_s=90)
        ids, last = asyncio.run(collect(client, GenerateRequest(rid="after", input_ids=[5, 6, 7],
                                                                 sampling_params=greedy(6))))
        assert last.finish_reason.kind == "length" and len(ids) == 6
    finally:
        client.shutdown()
