"""vllm:iteration_tokens_total (shoal:iteration_tokens): the tokens of each engine step, counted by the
scheduler at vLLM's bounds and summed over replicas; and vllm:request_success{finished_reason="abort"}: a
request its client abandoned counts once, as one /abort_request stops does."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from collections.abc import Iterator

import aiohttp
import pytest
from gw_helpers import GATEWAY_ARGS, http, slow_steps, wait_kv_full
from prometheus_client.parser import text_string_to_metric_families

from runtime import Engine
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.server import serve_in_thread
from runtime.managers.stats import ForwardModeStats
from runtime.messages import ITERATION_TOKEN_BOUNDS, SchedulerStats
from runtime.model_executor.forward_mode import ForwardMode

INF = float("inf")
VLLM_BOUNDS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]  # vllm/v1/metrics/loggers.py


def scrape(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(urllib.request.urlopen(url + "/metrics").read().decode())}


def hist(fam) -> tuple[dict[float, float], float, float]:
    """(cumulative count per bound, count, sum) of a histogram family's one series."""
    buckets = {float(s.labels["le"]): s.value for s in fam.samples if s.name.endswith("_bucket")}
    [count] = [s.value for s in fam.samples if s.name.endswith("_count")]
    [total] = [s.value for s in fam.samples if s.name.endswith("_sum")]
    return buckets, count, total


def expected(values: list[int]) -> tuple[dict[float, float], float, float]:
    return {float(b): sum(v <= b for v in values) for b in [*VLLM_BOUNDS, INF]}, len(values), sum(values)


def grew(after: dict, before: dict, name: str) -> tuple[dict[float, float], float, float]:
    (b1, c1, s1), (b0, c0, s0) = hist(after[name]), hist(before[name])
    return {b: b1[b] - b0[b] for b in b1}, c1 - c0, s1 - s0


def test_steps_counted_at_vllm_bounds():
    """Each step lands in vLLM's bucket (le: tokens <= bound); IDLE (a DP rank with no work) and the draft
    model's DRAFT_EXTEND are no steps; replicas' counts add up; both names serve the same series."""
    assert list(ITERATION_TOKEN_BOUNDS) == VLLM_BOUNDS
    a, b = ForwardModeStats(), ForwardModeStats()
    steps_a = [(ForwardMode.EXTEND, 8), (ForwardMode.DECODE, 1), (ForwardMode.MIXED, 9), (ForwardMode.EXTEND, 16385),
               (ForwardMode.TARGET_VERIFY, 16)]
    for mode, n in [*steps_a, (ForwardMode.IDLE, 0), (ForwardMode.DRAFT_EXTEND, 4)]:
        a.record(mode, n)
    for mode, n in [(ForwardMode.DECODE, 1), (ForwardMode.IDLE, 0), (ForwardMode.EXTEND, 16384)]:
        b.record(mode, n)
    assert a.modes["IDLE"].batches == a.modes["DRAFT_EXTEND"].batches == 1  # still counted per mode
    total = SchedulerStats.summed([SchedulerStats(**a.iteration_fields()), SchedulerStats(),
                                   SchedulerStats(**b.iteration_fields())])
    values = [n for _, n in steps_a] + [1, 16384]
    assert total.iteration_tokens_sum == sum(values)
    fams = {f.name: f for f in text_string_to_metric_families(
        GatewayMetrics(("vllm",), model_name=lambda: "tiny").render(total).decode())}
    assert fams["vllm:iteration_tokens_total"].type == "histogram"
    assert hist(fams["vllm:iteration_tokens_total"]) == hist(fams["shoal:iteration_tokens"]) == expected(values)
    assert {(k, v) for s in fams["vllm:iteration_tokens_total"].samples for k, v in s.labels.items()
            if k != "le"} == {("model_name", "tiny"), ("engine", "0")}
    ready = {f.name for f in text_string_to_metric_families(GatewayMetrics(("vllm",)).render(None).decode())}
    assert "vllm:iteration_tokens_total" not in ready  # engine not ready: no scheduler series, as for the rest


def test_replicas_of_other_lengths_merge():
    """Replicas whose iteration_tokens differ in length (another release's bounds) add up bucket by bucket,
    the shorter padded with 0; the scrape reads len(bounds) + 1 buckets, extras folded into +Inf, so +Inf
    is there and equals _count."""
    size = len(ITERATION_TOKEN_BOUNDS) + 1
    full = [1] * size
    short = [2, 3]  # steps of 1 and of 2..8 tokens
    longer = [0] * size + [4, 5]  # 9 steps past our last bound, at bounds we don't know
    total = SchedulerStats.summed([SchedulerStats(iteration_tokens=full), SchedulerStats(),
                                   SchedulerStats(iteration_tokens=short), SchedulerStats(iteration_tokens=longer)])
    assert total.iteration_tokens == [3, 4, *[1] * (size - 2), 4, 5]
    fams = {f.name: f for f in text_string_to_metric_families(
        GatewayMetrics(("vllm",), model_name=lambda: "tiny").render(total).decode())}
    for name in ("vllm:iteration_tokens_total", "shoal:iteration_tokens"):
        buckets, count, _ = hist(fams[name])
        assert list(buckets) == [*map(float, VLLM_BOUNDS), INF]
        assert buckets[INF] == count == size + 5 + 9
        assert buckets[1.0] == 3 and buckets[8.0] == 7 and buckets[16384.0] == count - 1 - 9  # full's +Inf, extras
    only_short = {f.name: f for f in text_string_to_metric_families(GatewayMetrics(("vllm",)).render(
        SchedulerStats(iteration_tokens=short)).decode())}
    buckets, count, _ = hist(only_short["vllm:iteration_tokens_total"])
    assert buckets[INF] == buckets[8.0] == count == 5


@pytest.fixture(scope="module", params=[-1, 8], ids=["unchunked", "chunk8"])
def served(request, tiny_llama) -> Iterator[tuple[str, int]]:
    engine = Engine(str(tiny_llama), device="cpu", max_total_tokens=2048, chunked_prefill_size=request.param,
                    log_level="warning")
    try:
        with serve_in_thread(engine, GATEWAY_ARGS, port=0) as server:
            yield server.url, request.param
    finally:
        engine.shutdown()


def test_one_completion_steps(served):
    """A completion of 21 prompt tokens and 6 output tokens: its prefill (one step, or chunks of 8), then one
    decode step of 1 token per output token after the first (the last one is never fed back): prompt +
    output - 1 tokens in all."""
    url, chunk = served
    prompt = random.Random(chunk).sample(range(5, 400), 21)  # fresh tokens: no prefix-cache hit
    before = scrape(url)
    status, r = http(url + "/v1/completions", "POST", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                       "ignore_eos": True})
    assert status == 200 and r["usage"]["completion_tokens"] == 6, r
    after = scrape(url)
    prefill = [21] if chunk < 0 else [8, 8, 5]
    want = expected(prefill + [1] * 5)
    assert want[2] == 21 + 6 - 1
    assert grew(after, before, "vllm:iteration_tokens_total") == want
    assert grew(after, before, "shoal:iteration_tokens") == want
    [labels] = {tuple(sorted(s.labels.items())) for s in after["vllm:iteration_tokens_total"].samples
                if s.name.endswith("_count")}
    assert labels == (("engine", "0"), ("model_name", http(url + "/v1/models")[1]["data"][0]["id"]))


def aborts(fams: dict) -> tuple[float, float]:
    """vLLM's and our count of requests that ended aborted."""
    def of(name: str, key: str) -> float:
        return next(s.value for s in fams[name].samples if s.name.endswith("_total") and s.labels[key] == "abort")
    return of("vllm:request_success", "finished_reason"), of("shoal:requests_finished", "reason")


async def settled_aborts(url: str, engine: Engine, want: float) -> tuple[float, float]:
    """The abort counts once the gateway has seen the client go and the engine freed its requests (the
    count, made as the handler ends, may come a moment after)."""
    await asyncio.to_thread(wait_kv_full, engine)
    deadline = time.monotonic() + 5
    while (got := aborts(await asyncio.to_thread(scrape, url)))[0] < want and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # nothing more comes (once each)
    return aborts(await asyncio.to_thread(scrape, url)) if got[0] >= want else got


# One streamed choice reads its stream directly, several go through the fan-in; a plain (non-streamed) one
# is left while it waits for its answer.
@pytest.mark.parametrize("stream,n", [(True, 1), (True, 2), (False, 1)])
async def test_client_disconnect_counts_abort(gw_url, gw_engine, monkeypatch, stream, n):
    slow_steps(gw_engine, monkeypatch, 0.003)  # 400 tokens must not all come before the client leaves
    (v0, s0), before = aborts(scrape(gw_url)), scrape(gw_url)
    body = {"prompt": "Tell me a long story", "max_tokens": 400, "n": n, "stream": stream, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None if stream else 0.4)) as session:
        try:
            resp = await session.post(gw_url + "/v1/completions", json=body)
            assert resp.status == 200 and stream
            seen = 0
            async for line in resp.content:
                seen += line.startswith(b"data: ")
                if seen >= 3:
                    break
            resp.close()  # the client leaves mid-stream
        except asyncio.TimeoutError:  # the client gives up waiting
            assert not stream
    assert await settled_aborts(gw_url, gw_engine, v0 + n) == (v0 + n, s0 + n)
    after = scrape(gw_url)
    # Counted as a finished request whole: its latency and its lengths (what it generated before it left).
    assert grew(after, before, "vllm:e2e_request_latency_seconds")[1] == n
    _, count, generated = grew(after, before, "vllm:request_generation_tokens")
    assert count == n and 0 < generated < n * 400


async def test_abort_request_counts_once(gw_url, gw_engine, monkeypatch):
    """/abort_request ends a streamed request with finish_reason abort: one count. A client that leaves
    right after its /abort_request (whether or not its handler read that last delta) counts once too."""
    slow_steps(gw_engine, monkeypatch, 0.003)
    v0, s0 = aborts(scrape(gw_url))
    body = {"prompt": "Count to a thousand", "max_tokens": 400, "stream": True, "ignore_eos": True}

    async def run(session: aiohttp.ClientSession, leave: bool) -> str | None:
        reason = None
        async with session.post(gw_url + "/v1/completions", json=body) as resp:
            aborted = False
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if not aborted:
                    async with session.post(gw_url + "/abort_request", json={"rid": event["id"]}) as r:
                        assert (await r.json())["aborted"]
                    aborted = True
                    if leave:
                        return None
                if event["choices"] and event["choices"][0]["finish_reason"]:
                    reason = event["choices"][0]["finish_reason"]
        return reason

    async with aiohttp.ClientSession() as session:
        assert await run(session, leave=False) == "abort"
        assert await settled_aborts(gw_url, gw_engine, v0 + 1) == (v0 + 1, s0 + 1)
        await run(session, leave=True)
    assert await settled_aborts(gw_url, gw_engine, v0 + 2) == (v0 + 2, s0 + 2)
