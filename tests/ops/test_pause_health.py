"""/health_generate and weight-update refusals while paused, on one tiny-Llama Engine (in process): while paused
/health_generate answers 200 at once, without a probe request (one would be held until continue), its body saying
generation is paused; after continue it runs its probe again. SchedulerHost.check_update (the "would you take this
update" every replica answers before any loads on Ray) refuses a flushing update while a request paused in place
holds KV, and not one that keeps the cache or aborts the requests first; the SchedulerActor answers it as a typed
AdminReply; the load-time check still refuses in process (the old weights serve, HF's tokens after continue)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from runtime import Engine
from runtime.admin_messages import AdminReply, UpdateProbe
from runtime.cluster.scheduler_actor import SchedulerActor
from runtime.config import ServerArgs

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]
N = 12
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    e = Engine(str(tiny_llama), device="cpu", dtype="float32", max_total_tokens=2048, log_level="warning")
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ids = list(PROMPT)
    with torch.inference_mode():  # argmax at every step, EOS included (the engine ignores it)
        for _ in range(N):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


def test_health_generate_answers_without_a_probe_while_paused(engine):
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    async def go() -> list[tuple[int, dict, float]]:
        seen = []
        async with TestClient(TestServer(build_app(engine, engine.args))) as http:
            for path in ("/health_generate", "/pause_generation", "/health_generate", "/continue_generation",
                         "/health_generate"):
                t0 = time.monotonic()
                r = await (http.post(path) if path.endswith("generation") else http.get(path))
                seen.append((r.status, await r.json(), time.monotonic() - t0))
                if path == "/health_generate" and engine.host.paused:
                    assert engine.host._held == []  # no probe is waiting for the continue
        return seen

    before, paused, during, _, after = asyncio.run(go())
    assert before[:2] == after[:2] == (200, {"status": "ok"})  # the probe ran
    assert paused[0] == 200 and engine.host.paused is None
    status, body, took = during
    assert status == 200 and body["status"] == "ok" and body["generation"] == "paused" and took < 5
    assert body["message"].startswith("generation is paused on 1 scheduler (/pause_generation)")
    assert engine.get_stats().paused_replicas == 0


async def _running_in_place(engine: Engine) -> tuple[asyncio.Future, Any]:
    """A long request, paused in place once it runs: the scheduler is frozen on its own thread as it picks the
    next batch after the request's first tokens (tests/ops/test_pause_generation.py says why), then paused."""
    s = engine.scheduler
    pick = s.get_next_batch_to_run

    def picking() -> Any:
        if any(len(r.output_ids) >= 2 for r in s.running):
            s.paused = True
        return pick()

    s.get_next_batch_to_run = picking
    try:
        fut = asyncio.ensure_future(engine.async_generate(input_ids=PROMPT, sampling_params={"max_new_tokens": N,
                                                                                             **GREEDY}))
        deadline = time.monotonic() + 60
        while not await asyncio.to_thread(engine.host.call, lambda: s.paused and bool(s.running)):
            assert not fut.done() and time.monotonic() < deadline, "the request never ran"
            await asyncio.sleep(0.001)
    finally:
        del s.get_next_batch_to_run
    await asyncio.to_thread(engine.pause_generation, "in_place")
    return fut, s.running[0]


def test_update_check_while_a_request_is_paused_in_place(engine, tiny_llama, expected):
    actor = SchedulerActor(ServerArgs(), "/m", SimpleNamespace(rank=0))
    actor.host = engine.host
    assert engine.host.check_update(UpdateProbe()) == AdminReply()  # nothing paused: it would load

    async def scenario() -> tuple[list[AdminReply], tuple, Any, int]:
        fut, req = await _running_in_place(engine)
        replies = [await asyncio.to_thread(engine.host.check_update, p) for p in (
            UpdateProbe(), UpdateProbe(flush_cache=False), UpdateProbe(abort_all_requests=True))]
        replies.append(await actor.check_update(UpdateProbe()))  # what crosses to the Ray client
        refused = await asyncio.to_thread(engine.update_weights_from_disk, str(tiny_llama))  # load-time check
        held = len(req.output_ids)
        await asyncio.to_thread(engine.continue_generation)
        return replies, refused, await fut, held

    replies, (ok, message, _), out, held = asyncio.run(scenario())
    flushing, keeping, aborting, via_actor = replies
    assert flushing.error is not None and flushing.error.startswith("1 requests paused in place hold KV")
    assert keeping.error is None and aborting.error is None and via_actor == flushing
    assert not ok and message == flushing.error and engine.host.weight_version == "default"  # not loaded
    assert 2 <= held < N and out["output_ids"] == expected  # it went on over its KV after continue
    assert engine.host.check_update(UpdateProbe()) == AdminReply()
