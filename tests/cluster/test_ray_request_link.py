"""The Ray client's direct link to its scheduler actor (the default) against actor calls and long polls
(--disable-request-link) and the in-process Engine: the same greedy tokens; the first token's
FirstTokenTrace has every hop stamped, in order; a stream closed early is aborted over the link and a
client that goes away has its requests ended, so the replica's KV pool is whole again."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray_helpers import greedy, run_all

from runtime.config import ServerArgs
from runtime.messages import GenerateRequest

pytestmark = pytest.mark.ray

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45], [300, 12, 99]]


def wait_until_idle(client, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.replica_stats_sync()[0]
        if stats.num_running_reqs == 0 and stats.num_queue_reqs == 0 and stats.num_used_tokens == 0:
            return
        assert time.monotonic() < deadline, f"replica still busy: {stats}"
        time.sleep(0.05)


async def first_then_close(client, rid: str) -> object:
    req = GenerateRequest(rid=rid, input_ids=[7, 8, 9], arrival_time=time.monotonic(),
                          sampling_params=greedy(400, ignore_eos=True))
    stream = client.stream(client.validate(req))
    first = await stream.__anext__()
    await stream.aclose()  # the consumer goes away: the request is aborted on the replica
    return first


def test_link_and_polls_give_the_engine_tokens_and_free_kv(ray_local, tiny_llama):
    from runtime import Engine
    from runtime.cluster.launch import create_ray_engine_client

    with Engine(str(tiny_llama), device="cpu", max_total_tokens=2048) as engine:
        expected = [engine.generate(input_ids=p, sampling_params={"max_new_tokens": 10, "temperature": 0})["output_ids"]
                    for p in PROMPTS]
    for link in (True, False):
        client = create_ray_engine_client(ServerArgs(model_path=str(tiny_llama), device="cpu", max_total_tokens=2048,
                                                     disable_request_link=not link))
        try:
            assert (client._links.get(0) is not None) == link
            reqs = [GenerateRequest(rid=f"{link}-{i}", input_ids=p, sampling_params=greedy(10), arrival_time=time.monotonic())
                    for i, p in enumerate(PROMPTS)]
            assert [ids for ids, _ in run_all(client, reqs)] == expected

            first = asyncio.run(first_then_close(client, f"early-{link}"))
            tr = first.trace
            assert tr is not None and first.new_token_ids
            assert 0 < tr.scheduled <= tr.result <= tr.queued <= tr.polled <= tr.received <= time.monotonic()
            wait_until_idle(client)
        finally:
            client.shutdown()


def test_a_gone_client_has_its_requests_ended(ray_local, tiny_llama):
    """A second consumer links to the same actor, starts a request and goes away mid-stream."""
    import ray

    from runtime.cluster.launch import create_ray_engine_client
    from runtime.cluster.request_link import RequestLink

    client = create_ray_engine_client(ServerArgs(model_path=str(tiny_llama), device="cpu", max_total_tokens=2048))
    actor = client.groups[0].schedulers[0]
    try:
        async def start_and_leave() -> None:
            link = await RequestLink.open(tuple(ray.get(actor.link_address.remote())), "another-client", None)
            link.submit(client.validate(GenerateRequest(rid="left", input_ids=[3, 4, 5],
                                                        sampling_params=greedy(400, ignore_eos=True))))
            poll = await asyncio.wait_for(link.next_poll(), 10)
            assert {o.rid for o in poll.outputs} == {"left"} and poll.healthy  # one or more of its deltas
            link.close()

        asyncio.run(start_and_leave())
        deadline = time.monotonic() + 10
        while ray.get(actor.stats.remote()).num_running_reqs:
            assert time.monotonic() < deadline, "the request of the gone client still runs"
            time.sleep(0.05)
        stats = ray.get(actor.stats.remote())
        assert stats.num_used_tokens == 0
        assert stats.forward_modes["DECODE"].batches < 300  # ended early, not by its 400-token length
        assert client.is_ready()  # the other client's link is untouched
    finally:
        client.shutdown()
