"""--max-concurrent-requests: past the limit (each choice counts) a new request gets 429 with Retry-After
and is counted in /metrics; a request with more choices than the limit is a 400; once requests end, their
places are free again."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from gw_helpers import GATEWAY_ARGS, http, slow_steps, wait_kv_full

from runtime.gateway.server import serve_in_thread


def test_requests_past_the_limit_get_429(gw_engine, monkeypatch):
    slow_steps(gw_engine, monkeypatch, 0.01)
    body = {"prompt": "Tell me a story", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(max_concurrent_requests=2), port=0) as server:
        url = server.url

        async def scenario() -> None:
            async with aiohttp.ClientSession() as session:
                running = [await session.post(url + "/v1/completions", json=body) for _ in range(2)]
                for r in running:
                    assert r.status == 200
                    await r.content.readline()  # streaming: both hold their places
                async with session.post(url + "/v1/completions", json={**body, "stream": False}) as r:
                    assert r.status == 429 and r.headers["Retry-After"] == "1"
                    err = (await r.json())["error"]
                    assert err["code"] == "too_many_requests" and "2 concurrent" in err["message"]
                async with session.post(url + "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 2}) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "n"
                for r in running:
                    r.close()  # the clients leave: their requests are aborted and untracked

        asyncio.run(scenario())
        deadline = time.monotonic() + 30
        while True:
            status, _ = http(url + "/v1/completions", "POST", {"prompt": "hi", "max_tokens": 2})
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status == 200
        _, metrics = http(url + "/metrics")
        [line] = [ln for ln in metrics.splitlines() if ln.startswith("shoal:requests_rejected_total ")]
        assert float(line.split()[1]) >= 1  # the 429 above, and any while the aborted ones were ending
    wait_kv_full(gw_engine)


def test_batch_larger_than_the_queue_is_a_400_not_a_429(gw_engine):
    # A 429 would tell the client to retry a request that can never fit the queue, however idle the server.
    args = GATEWAY_ARGS.replace(max_waiting_requests=4)
    with serve_in_thread(gw_engine, args, port=0) as server:
        status, body = http(server.url + "/v1/completions", "POST",
                            {"prompt": [[5, 6, 7]] * 5, "max_tokens": 1})
        assert status == 400, body
        assert body["error"]["param"] == "prompt" and "at most 4" in body["error"]["message"]
        status, body = http(server.url + "/v1/completions", "POST",
                            {"prompt": [[5, 6, 7]] * 4, "max_tokens": 1})
        assert status == 200 and len(body["choices"]) == 4
    wait_kv_full(gw_engine)
