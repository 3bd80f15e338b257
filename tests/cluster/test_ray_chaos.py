"""Chaos: DP=2 (tp=1) behind the HTTP gateway, 32 concurrent greedy SSE streams; the OS process of one
replica's scheduler actor (TP rank 0, the replica's only rank) is SIGKILLed mid-stream. Every stream
completes, its text identical to an undisturbed run (the moved ones continue on the other replica from
the tokens they had streamed: nothing missing, nothing repeated); the failovers show in /metrics; the
dead replica is relaunched and later requests (new prompts) use both replicas again; the KV pools end
full."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from runtime.config import ServerArgs

pytestmark = pytest.mark.ray

N, MAX_TOKENS = 32, 24


async def stream_text(session: aiohttp.ClientSession, url: str, i: int, chunks: list[int],
                      topic: str = "Story") -> tuple[str, str]:
    body = {"prompt": f"{topic} {i}: the quick brown fox", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, finish = "", ""
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            choice = event["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            chunks[i] += 1
    return text, finish


async def run_streams(url: str, on_progress=None, topic: str = "Story") -> list[tuple[str, str]]:
    chunks = [0] * N
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(stream_text(session, url, i, chunks, topic)) for i in range(N)]
        if on_progress is not None:
            while sum(c > 1 for c in chunks) < N // 2 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.005)
            on_progress(chunks)
        return await asyncio.gather(*tasks)


def test_sigkill_a_replica_mid_stream(ray_local, tiny_llama):
    import ray
    import requests

    from runtime.cluster.launch import create_ray_engine_client
    from runtime.gateway.server import serve_in_thread

    args = ServerArgs(model_path=str(tiny_llama), dp_size=2, device="cpu", dtype="float32", max_total_tokens=4096,
                      log_level="warning")
    client = create_ray_engine_client(args)
    server = serve_in_thread(client, args, port=0)
    try:
        reference = asyncio.run(run_streams(server.url))
        assert all(f == "length" for _, f in reference)
        pid = ray.get(client.groups[0].schedulers[0].pid.remote())
        killed: list[list[int]] = []

        def kill(chunks: list[int]) -> None:
            killed.append(list(chunks))
            os.kill(pid, signal.SIGKILL)

        t0 = time.monotonic()
        disturbed = asyncio.run(run_streams(server.url, kill))
        took = time.monotonic() - t0
        assert killed and sum(0 < c < MAX_TOKENS for c in killed[0]) > 0  # it died with streams mid-way
        assert disturbed == reference  # 32/32 complete, each text identical
        stats = client.routing_stats()
        assert stats.failovers >= 1 and stats.failover_errors == 0, stats
        metrics = requests.get(server.url + "/metrics", timeout=10).text
        assert f"shoal:failovers_total {float(stats.failovers)}" in metrics
        assert took < 30
        client.wait_until_healthy(timeout_s=60)
        assert client.restarts == 1
        before = [s.cache_query_tokens for s in client.replica_stats_sync()]
        # New prompts (the old ones are cached only on the replica that survived, where cache_aware rightly
        # keeps sending them): load spreads them over both.
        again = asyncio.run(run_streams(server.url, topic="Tale"))
        assert all(f == "length" for _, f in again)
        after = [s.cache_query_tokens for s in client.replica_stats_sync()]
        assert all(a > b for a, b in zip(after, before)), (before, after)  # both replicas, relaunched included
        deadline = time.monotonic() + 10
        while any(s.num_used_tokens for s in client.replica_stats_sync()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(s.num_used_tokens == 0 and s.num_running_reqs == 0 for s in client.replica_stats_sync())
    finally:
        server.stop()
        client.shutdown()
