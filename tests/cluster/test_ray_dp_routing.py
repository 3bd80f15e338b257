"""DP=2 independent replicas behind one RayEngineClient: round_robin spreads traffic, least_load sends
new work to the emptier replica, prefix_hash keeps requests with one prefix on one replica. Which
replica served a request is read back from each replica's own scheduler stats (prompt tokens seen)."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray_helpers import collect, greedy, run_all

from runtime.cluster.routing import create_routing_policy
from runtime.config import ServerArgs
from runtime.messages import GenerateRequest

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def dp_client(tiny_model_dirs, ray_session):
    from ray_helpers import start_local_ray

    from runtime.cluster.launch import create_ray_engine_client

    start_local_ray()
    client = create_ray_engine_client(ServerArgs(model_path=str(tiny_model_dirs["llama"]), dp_size=2, device="cpu",
                                                 max_total_tokens=2048, disable_radix_cache=True))
    yield client
    client.shutdown()


def prompt_tokens_seen(client) -> list[int]:
    return [s.cache_query_tokens for s in client.replica_stats_sync()]


def settle(client) -> None:
    """Waits for a health round: loads then come from the replicas' real (idle) stats."""
    time.sleep(client.health_interval_s * 2.5)
    assert all(r.load == 0 for r in client.replicas)


def req(rid: str, ids: list[int], n: int = 4) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=ids, sampling_params=greedy(n))


def test_round_robin_uses_both(dp_client):
    dp_client.policy = create_routing_policy("round_robin")
    before = prompt_tokens_seen(dp_client)
    results = run_all(dp_client, [req(f"rr{i}", [10 + i] * 10) for i in range(4)])
    assert all(last.finish_reason.kind == "length" for _, last in results)
    after = prompt_tokens_seen(dp_client)
    assert [a - b for a, b in zip(after, before)] == [20, 20]
    modes = [s.forward_modes for s in dp_client.replica_stats_sync()]
    assert all(m["EXTEND"].batches > 0 and m["DECODE"].batches > 0 for m in modes)


def test_least_load_prefers_emptier_replica(dp_client):
    dp_client.policy = create_routing_policy("least_load")
    settle(dp_client)
    before = prompt_tokens_seen(dp_client)

    async def scenario():
        big = asyncio.ensure_future(collect(dp_client, GenerateRequest(
            rid="big", input_ids=list(range(20, 220)), sampling_params=greedy(300, ignore_eos=True))))  # outlives the small ones
        await asyncio.sleep(0.3)  # the big one is running on the replica it was routed to
        small = [await collect(dp_client, req(f"small{i}", [30 + i] * 10)) for i in range(3)]
        return await big, small

    big, small = asyncio.run(scenario())
    assert big[1].completion_tokens == 300 and all(s[1].finish_reason.kind == "length" for s in small)
    delta = [a - b for a, b in zip(prompt_tokens_seen(dp_client), before)]
    assert sorted(delta) == [30, 200]  # all three small prompts went to the replica without the big one


def test_prefix_hash_is_sticky(dp_client):
    dp_client.policy = create_routing_policy("prefix_hash")
    shared = list(range(100, 132))  # 32 tokens: the hashed prefix
    before = prompt_tokens_seen(dp_client)
    run_all(dp_client, [req(f"ph{i}", shared + [200 + i] * (i + 1)) for i in range(4)])
    delta = [a - b for a, b in zip(prompt_tokens_seen(dp_client), before)]
    assert sorted(delta) == [0, 4 * 32 + 1 + 2 + 3 + 4]
    # Different prefixes spread over both replicas (consistent hashing, 64 points per replica).
    before = prompt_tokens_seen(dp_client)
    run_all(dp_client, [req(f"pd{i}", [50 + 7 * i] * 33) for i in range(12)])
    delta = [a - b for a, b in zip(prompt_tokens_seen(dp_client), before)]
    assert sum(delta) == 12 * 33 and min(delta) > 0


def test_duplicate_rid_is_refused_not_mixed(dp_client):
    # A second stream with a rid in flight would take over the first one's outputs: refuse it.
    from runtime.errors import InvalidRequestError

    async def scenario():
        first = dp_client.stream(dp_client.validate(req("dup", [7] * 8, 30)))
        await first.__anext__()
        with pytest.raises(InvalidRequestError, match="already in use"):
            await dp_client.stream(dp_client.validate(req("dup", [7] * 8, 3))).__anext__()
        outs = [o async for o in first]
        return outs[-1]

    last = asyncio.run(scenario())
    assert last.finish_reason.kind == "length" and last.completion_tokens == 30
