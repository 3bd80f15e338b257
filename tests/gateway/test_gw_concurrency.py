"""Many clients at once, and clients that go away: their requests are aborted and the KV pool returns to
full (every slot free or evictable prefix cache, accounting intact)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from gw_helpers import slow_steps, wait_kv_full


async def _stream_text(session: aiohttp.ClientSession, url: str, i: int) -> tuple[str, int]:
    body = {"model": "llama", "prompt": f"Client {i} says hello", "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    text, usage, done = "", None, False
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                done = True
                break
            event = json.loads(payload)
            if event["choices"]:
                text += event["choices"][0]["text"]
            if event.get("usage"):
                usage = event["usage"]
    assert done and usage is not None
    return text, usage["completion_tokens"]


async def test_64_concurrent_streams(gw_url, gw_engine):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        results = await asyncio.gather(*(_stream_text(session, gw_url, i) for i in range(64)))
    assert all(n == 4 for _, n in results)
    # Same prompt, greedy: a request's output never depends on its batch mates.
    alone = gw_engine.generate(prompt="Client 7 says hello", sampling_params={"max_new_tokens": 4,
                                                                              "temperature": 0, "ignore_eos": True})
    assert results[7][0] == alone["text"]
    await asyncio.to_thread(wait_kv_full, gw_engine)


def _decode_tokens(engine) -> int:
    return engine.get_stats().forward_modes["DECODE"].tokens


@pytest.mark.parametrize("n", [1, 2])  # one choice reads its stream directly; several go through the fan-in
async def test_stream_disconnect_frees_kv(gw_url, gw_engine, n):
    before = _decode_tokens(gw_engine)
    body = {"messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 450, "n": n,
            "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(gw_url + "/v1/chat/completions", json=body)
        assert resp.status == 200
        seen = 0
        async for line in resp.content:
            if line.startswith(b"data: "):
                seen += 1
            if seen >= 6:
                break
        resp.close()  # drop the connection mid-stream
    await asyncio.to_thread(wait_kv_full, gw_engine)
    assert _decode_tokens(gw_engine) - before < n * 449  # aborted, not run to the end



async def test_non_stream_disconnect_frees_kv(gw_url, gw_engine, monkeypatch):
    slow_steps(gw_engine, monkeypatch, 0.003)
    before = _decode_tokens(gw_engine)
    body = {"prompt": "Tell me a long story", "max_tokens": 480, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.4)) as session:
        try:
            async with session.post(gw_url + "/v1/completions", json=body) as resp:
                await resp.read()
            raise AssertionError("the request should have outlived the client's timeout")
        except asyncio.TimeoutError:
            pass
    await asyncio.to_thread(wait_kv_full, gw_engine)
    assert _decode_tokens(gw_engine) - before < 479


async def test_abort_request_by_response_id_aborts_every_choice(gw_url, gw_engine, monkeypatch):
    slow_steps(gw_engine, monkeypatch, 0.003)  # 450 tokens must not all be generated before the abort lands
    body = {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 450, "n": 2, "stream": True,
            "ignore_eos": True}
    reasons: dict[int, str] = {}
    async with aiohttp.ClientSession() as session:
        async with session.post(gw_url + "/v1/chat/completions", json=body) as resp:
            aborted = None
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if aborted is None:
                    async with session.post(gw_url + "/abort_request", json={"rid": event["id"]}) as r:
                        aborted = (await r.json())["aborted"]
                for c in event["choices"]:
                    if c["finish_reason"]:
                        reasons[c["index"]] = c["finish_reason"]
    assert sorted(aborted) == [f"{event['id']}-0", f"{event['id']}-1"]
    assert reasons == {0: "abort", 1: "abort"}
    await asyncio.to_thread(wait_kv_full, gw_engine)
