"""vllm:lora_requests_info on /metrics (--enable-lora): one gauge series whose labels name the adapters of the
requests running and waiting (comma-joined, "" for none) and --max-loras, valued at the scrape's time; absent
without LoRA; several replicas' merged into one server's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from lora_files import write_adapter
from prometheus_client.parser import text_string_to_metric_families

from runtime import Engine
from runtime.gateway.metrics import GatewayMetrics
from runtime.messages import LoraRequests, SchedulerStats

NAME = "vllm:lora_requests_info"
LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")
PROMPT = [5, 9, 13, 40, 22, 7, 31, 18]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_metrics")
    a = write_adapter(root / "a", tiny_llama, 21, ("q_proj", "v_proj"))
    b = write_adapter(root / "b", tiny_llama, 22, ("q_proj", "o_proj"))
    # One request runs at a time: a second one waits behind the first.
    e = Engine(str(tiny_llama), device="cpu", dtype="float32", max_total_tokens=2048, log_level="warning",
               enable_lora=True, lora_modules={"a": str(a), "b": str(b)}, max_loras=2, max_running_requests=1)
    yield e
    e.shutdown()


def lora_samples(text: str) -> list:
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    if NAME not in fams:
        return []
    assert fams[NAME].type == "gauge"
    return fams[NAME].samples


def test_running_and_waiting_adapters_through_the_server(engine, monkeypatch):
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    run = engine.worker.runner.run_batch

    def slow(batch):  # steps long enough to scrape while `a` runs and `b` waits
        time.sleep(0.04)
        return run(batch)

    monkeypatch.setattr(engine.worker.runner, "run_batch", slow)

    async def scenario() -> None:
        async with TestClient(TestServer(build_app(engine, engine.args))) as http:
            async def scrape() -> list:
                return lora_samples(await (await http.get("/metrics")).text())

            async def complete(model: str, n: int) -> dict:
                r = await http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": n,
                                                             "temperature": 0, "ignore_eos": True})
                assert r.status == 200
                return await r.json()

            before = time.time()
            [idle] = await scrape()
            assert dict(idle.labels) == dict(zip(LABELS, ("2", "", "")))
            assert before <= idle.value <= time.time()  # vLLM's value: a Unix time, here the scrape's

            first = asyncio.ensure_future(complete("a", 40))
            deadline = time.monotonic() + 30
            while not any(r.lora_id for r in engine.scheduler.live_reqs()):
                assert time.monotonic() < deadline and not first.done()
                await asyncio.sleep(0.005)
            second = asyncio.ensure_future(complete("b", 2))
            while True:  # until `b` is queued: `a` still runs then (40 steps of 40 ms)
                assert time.monotonic() < deadline and not first.done()
                [busy] = await scrape()
                if busy.labels["waiting_lora_adapters"]:
                    break
                assert dict(busy.labels) == dict(zip(LABELS, ("2", "", "a")))
                await asyncio.sleep(0.01)
            assert dict(busy.labels) == dict(zip(LABELS, ("2", "b", "a")))
            outs = await asyncio.gather(first, second)
            assert [o["usage"]["completion_tokens"] for o in outs] == [40, 2]
            assert [o["model"] for o in outs] == ["a", "b"]
            [done] = await scrape()
            assert dict(done.labels) == dict(zip(LABELS, ("2", "", "")))  # one series: the old label sets go

            # The same engine seen as one without LoRA: no series.
            monkeypatch.setattr(engine.scheduler.lora_ids, "enabled", False)
            assert engine.get_stats().lora is None and await scrape() == []

    asyncio.run(scenario())


def test_served_under_vllm_only_and_merged_over_replicas():
    one = SchedulerStats(lora=LoraRequests(max_loras=2, running=["a"], waiting=["b", "c"]))
    two = SchedulerStats(lora=LoraRequests(max_loras=2, running=["c", "a"], waiting=[]))
    total = SchedulerStats.summed([one, two, SchedulerStats()])
    assert total.lora == LoraRequests(max_loras=4, running=["a", "c"], waiting=["b", "c"])
    assert SchedulerStats.summed([SchedulerStats(), SchedulerStats()]).lora is None

    [s] = lora_samples(GatewayMetrics(("vllm",)).render(total).decode())
    assert dict(s.labels) == dict(zip(LABELS, ("4", "b,c", "a,c")))
    assert lora_samples(GatewayMetrics(("sglang",)).render(total).decode()) == []
    assert lora_samples(GatewayMetrics(("vllm",)).render(SchedulerStats()).decode()) == []
