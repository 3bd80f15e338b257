"""bench_serving against a fake OpenAI-compatible streaming server started inside the test (loopback,
ephemeral port): token counts, latency ordering, failures, timeouts, concurrency cap, result JSON."""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bench_serving  # noqa: E402
from benchmarks.common import percentile, sample_lengths  # noqa: E402

PREFILL_S = 0.02
CHUNK_S = 0.002


class FakeServer:
    """Streams one chunk per requested token after a short 'prefill', then a usage chunk and [DONE]."""

    def __init__(self) -> None:
        self.fail_if: Callable[[Any], bool] = lambda prompt: False
        self.hang_if: Callable[[Any], bool] = lambda prompt: False
        self.in_flight = 0
        self.max_in_flight = 0
        self.served = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/generate", self.generate)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _open(self, request: web.Request, prompt: Any) -> web.StreamResponse | None:
        if self.fail_if(prompt):
            return None
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(30 if self.hang_if(prompt) else PREFILL_S)
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = await self._open(request, prompt)
            if resp is None:
                return web.Response(status=500, text="internal error")
            n = body["max_tokens"]
            for i in range(n):
                choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
                choice |= {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
                await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                await asyncio.sleep(CHUNK_S)
            usage = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else len(prompt.split()),
                     "completion_tokens": n, "total_tokens": 0}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            self.served += 1
            return resp
        finally:
            self.in_flight -= 1

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        resp = await self._open(request, ids)
        if resp is None:
            return web.Response(status=500, text="internal error")
        for i in range(n):
            meta = {"prompt_tokens": len(ids), "completion_tokens": i + 1,
                    "finish_reason": {"type": "length"} if i == n - 1 else None}
            await resp.write(f"data: {json.dumps({'text': 'x' * (i + 1), 'meta_info': meta})}\n\n".encode())
            await asyncio.sleep(CHUNK_S)
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def server() -> AsyncIterator[tuple[FakeServer, str]]:
    fake = FakeServer()
    runner = web.AppRunner(fake.app(), shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield fake, f"http://{host}:{port}"
    await runner.cleanup()


def argv(base_url: str, *extra: str) -> list[str]:
    return ["--base-url", base_url, "--num-prompts", "16", "--random-input-len", "32",
            "--random-output-len", "8", "--random-range-ratio", "0.25", "--vocab-size", "1000",
            "--disable-tqdm", "--seed", "7", *extra]


async def run_bench(args_list: list[str]) -> tuple[dict[str, Any], list[bench_serving.RequestSpec]]:
    """Runs the benchmark in its own thread and loop, as main() does, while the fake serves on ours."""
    args = bench_serving.parse_args(args_list)
    specs = bench_serving.build_workload(args)
    metrics = await asyncio.to_thread(lambda: asyncio.run(bench_serving.benchmark(args, specs)))
    return metrics, specs


def assert_ordered(summary: dict[str, float]) -> None:
    assert summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"]
    assert 0 < summary["mean"] <= summary["max"]


async def test_counts_latencies_and_result_json(server, tmp_path):
    fake, url = server
    out = tmp_path / "res" / "serving.json"
    metrics = await asyncio.to_thread(bench_serving.main, argv(url, "--output-file", str(out)))
    specs = bench_serving.build_workload(bench_serving.parse_args(argv(url)))

    assert metrics["model"] == "fake-model"
    assert metrics["completed"] == 16 and metrics["failed"] == 0
    assert metrics["total_output_tokens"] == sum(s.output_len for s in specs) == metrics["expected_output_tokens"]
    assert metrics["total_input_tokens"] == sum(s.prompt_len for s in specs)
    assert metrics["usage_reported"] == 16
    for spec, r in zip(specs, metrics["requests"], strict=True):
        assert r["output_tokens"] == r["chunks"] == spec.output_len
        assert PREFILL_S * 0.9 <= r["ttft_s"] < r["e2e_s"]
    for name in ("ttft_ms", "itl_ms", "e2e_ms", "tpot_ms"):
        assert_ordered(metrics[name])
    assert metrics["ttft_ms"]["mean"] < metrics["e2e_ms"]["mean"]
    assert metrics["itl_ms"]["p50"] >= CHUNK_S * 1000 * 0.5
    assert metrics["output_throughput"] == pytest.approx(metrics["total_output_tokens"] / metrics["duration_s"])

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "serving"
    assert doc["device"] and doc["versions"]["aiohttp"] and "torch" in doc["versions"]
    assert doc["date"].endswith("+00:00")
    assert "--num-prompts 16" in doc["command"]
    assert doc["config"]["request_rate"] == "inf"
    assert doc["results"]["completed"] == 16


async def test_server_errors_are_counted(server):
    fake, url = server
    fake.fail_if = lambda prompt: prompt[0] % 3 == 0
    metrics, specs = await run_bench(argv(url))
    expected_failed = sum(1 for s in specs if s.prompt[0] % 3 == 0)
    assert 0 < expected_failed < 16
    assert metrics["failed"] == expected_failed
    assert metrics["completed"] == 16 - expected_failed
    assert metrics["errors"] == {"HTTP 500": expected_failed}
    ok_out = sum(s.output_len for s in specs if s.prompt[0] % 3 != 0)
    assert metrics["total_output_tokens"] == ok_out


async def test_hung_requests_time_out_and_run_ends(server):
    fake, url = server
    fake.hang_if = lambda prompt: prompt[0] % 2 == 1
    t0 = time.perf_counter()
    metrics, specs = await run_bench(argv(url, "--request-timeout", "0.4", "--warmup-requests", "0"))
    hung = sum(1 for s in specs if s.prompt[0] % 2 == 1)
    assert time.perf_counter() - t0 < 5
    assert metrics["failed"] == hung > 0
    assert list(metrics["errors"]) == ["timeout after 0.4s"]
    assert metrics["completed"] == 16 - hung


async def test_max_concurrency_caps_in_flight(server):
    fake, url = server
    metrics, _ = await run_bench(argv(url, "--max-concurrency", "3", "--warmup-requests", "0"))
    assert metrics["completed"] == 16
    assert fake.max_in_flight == 3


@pytest.mark.parametrize("backend", ["openai-chat", "shoal-generate"])
async def test_other_backends(server, backend):
    _, url = server
    metrics, specs = await run_bench(argv(url, "--backend", backend))
    assert metrics["completed"] == 16 and metrics["failed"] == 0
    assert metrics["total_output_tokens"] == sum(s.output_len for s in specs)
    if backend == "openai-chat":
        assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == s.prompt_len for s in specs)
    assert_ordered(metrics["ttft_ms"])


async def test_poisson_arrivals_follow_the_seeded_gaps():
    rate, n, seed = 200.0, 12, 3
    expected = sum(random.Random(seed).expovariate(rate) for _ in range(n - 1))
    t0 = time.perf_counter()
    got = [i async for i in bench_serving.arrivals(n, rate, random.Random(seed))]
    assert got == list(range(n))
    assert time.perf_counter() - t0 >= expected * 0.95
    t0 = time.perf_counter()
    assert len([i async for i in bench_serving.arrivals(n, math.inf, random.Random(seed))]) == n
    assert time.perf_counter() - t0 < 0.05


def test_lengths_follow_range_ratio():
    rng = random.Random(0)
    xs = sample_lengths(rng, 2000, 100, 0.5)
    assert min(xs) == 50 and max(xs) == 100
    assert sample_lengths(rng, 10, 64, 1.0) == [64] * 10
    assert min(sample_lengths(rng, 500, 10, 0.0)) == 1
    with pytest.raises(ValueError):
        sample_lengths(rng, 1, 10, 1.5)


def test_percentile_matches_numpy():
    xs = sorted(random.Random(1).random() for _ in range(37))
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))


def test_token_id_prompts_have_exact_lengths_and_no_special_ids():
    args = bench_serving.parse_args(["--num-prompts", "50", "--random-input-len", "40", "--random-output-len", "9",
                                     "--random-range-ratio", "0.5", "--model-config", "Llama-3.2-1B-Instruct"])
    specs = bench_serving.build_workload(args)
    assert [len(s.prompt) for s in specs] == [s.prompt_len for s in specs]
    assert all(20 <= s.prompt_len <= 40 and 4 <= s.output_len <= 9 for s in specs)
    ids = {t for s in specs for t in s.prompt}
    assert max(ids) < 128256 and not ids & {128000, 128001, 128008, 128009}
    body = bench_serving.request_body("openai-completions", "m", specs[0])
    assert body["prompt"] == specs[0].prompt and body["max_tokens"] == specs[0].output_len
