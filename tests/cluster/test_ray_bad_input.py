"""Out-of-range integers through the Ray client: validate() refuses them naming the field, before any
actor call; a request that skipped validate() fails alone in the SchedulerActor; and a request running
beside them on the same replica completes."""

from __future__ import annotations

import asyncio

import pytest
from ray_helpers import collect, greedy

from runtime.config import ServerArgs
from runtime.errors import InvalidRequestError
from runtime.messages import GenerateRequest
from runtime.sampling.params import SamplingParams

pytestmark = pytest.mark.ray


def test_huge_integers_fail_alone(ray_local, tiny_llama):
    from runtime.cluster.launch import create_ray_engine_client

    client = create_ray_engine_client(ServerArgs(model_path=str(tiny_llama), device="cpu", max_total_tokens=2048))
    try:
        for fields, param in (({"top_k": 2**63}, "top_k"), ({"stop_token_ids": [2**64]}, "stop_token_ids"),
                              ({"seed": 2**63}, "seed")):
            with pytest.raises(InvalidRequestError) as ei:
                client.validate(GenerateRequest(rid="bad", input_ids=[5, 6, 7],
                                                sampling_params=SamplingParams(max_new_tokens=4, **fields)))
            assert ei.value.param == param

        async def scenario():
            good = GenerateRequest(rid="good", input_ids=[5, 6, 7], sampling_params=greedy(30, ignore_eos=True))
            stream = client.stream(client.validate(good))
            first = await stream.__anext__()  # the good request runs on the replica now
            unchecked = GenerateRequest(rid="unchecked", input_ids=[5, 6, 7],
                                        sampling_params=SamplingParams(top_k=2**63, max_new_tokens=4))
            bad = [o async for o in client.stream(unchecked)]
            rest = [o async for o in stream]
            return first, rest, bad

        first, rest, bad = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert not first.finished
        [only] = bad
        assert only.finish_reason.kind == "error" and "top_k" in only.finish_reason.message
        assert rest[-1].finish_reason.kind == "length" and rest[-1].completion_tokens == 30
        ids, last = asyncio.run(collect(client, GenerateRequest(rid="after", input_ids=[8, 9],
                                                                 sampling_params=greedy(5, ignore_eos=True))))
        assert last.finish_reason.kind == "length" and len(ids) == 5
    finally:
        client.shutdown()
