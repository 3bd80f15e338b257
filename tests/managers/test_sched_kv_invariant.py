"""KV accounting after every scheduler step (free + cached + held by live requests == pool size) while a
mixed workload runs under each combination of chunking, MIXED, prefix cache, pool pressure and aborts;
outputs stay equal to an unconstrained reference."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from runtime import Engine


def workload(seed: int = 5, n: int = 14) -> list[tuple[list[int], dict]]:
    rng = random.Random(seed)
    shared = [rng.randint(3, 399) for _ in range(24)]
    out = []
    for i in range(n):
        tail = [rng.randint(3, 399) for _ in range(rng.randint(2, 50))]
        prompt = shared + tail if i % 3 == 0 else tail  # some share a prefix, to exercise the cache
        out.append((prompt, {"temperature": 0, "max_new_tokens": rng.randint(1, 20), "ignore_eos": True}))
    return out


def check_every_step(engine: Engine) -> list[str]:
    """Wraps the scheduler's step to check the KV invariant after each one; returns the failures seen."""
    s, real_step, errors = engine.scheduler, engine.scheduler.step, []
    lock = threading.Lock()

    def step() -> bool:
        did = real_step()
        with s.lock:
            try:
                s.check_kv_invariant()
                assert s.kv.allocator.available_size() >= 0
            except AssertionError as e:
                with lock:
                    errors.append(str(e))
        return did

    s.step = step  # run_forever looks the method up on every iteration
    return errors


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    with Engine(str(tiny_llama), device="cpu", max_total_tokens=4096, disable_radix_cache=True,
                log_level="warning") as e:
        w = workload()
        return [o["output_ids"] for o in e.generate(input_ids=[p for p, _ in w], sampling_params=[s for _, s in w])]


CONFIGS = {
    "default": {},
    "nocache": {"disable_radix_cache": True},
    "chunk8-mixed": {"chunked_prefill_size": 8, "enable_mixed_chunk": True},
    "chunk8-mixed-nocache": {"chunked_prefill_size": 8, "enable_mixed_chunk": True, "disable_radix_cache": True},
    "small-pool": {"max_total_tokens": 150, "init_new_token_ratio": 0.1, "min_new_token_ratio": 0.05},
    "small-pool-chunk16-mixed": {"max_total_tokens": 150, "chunked_prefill_size": 16, "enable_mixed_chunk": True,
                                 "init_new_token_ratio": 0.1, "min_new_token_ratio": 0.05},
    "small-pool-nocache-fcfs": {"max_total_tokens": 150, "disable_radix_cache": True, "schedule_policy": "fcfs",
                                "init_new_token_ratio": 0.1, "min_new_token_ratio": 0.05},
    "few-slots": {"max_running_requests": 3, "chunked_prefill_size": 16},
}


@pytest.mark.parametrize("name", list(CONFIGS))
async def test_invariant_every_step(make_engine, tiny_llama, reference, pool_full, name: str):
    engine = make_engine(tiny_llama, **CONFIGS[name])
    errors = check_every_step(engine)
    w = workload()

    async def one(i: int, prompt: list[int], params: dict) -> dict:
        await asyncio.sleep(0.003 * i)
        return await engine.async_generate(input_ids=prompt, sampling_params=params)

    async def aborted(delay: float) -> None:  # a request dropped mid-way, beside the others
        req = engine.make_request(input_ids=list(range(50, 80)),
                                  sampling_params={"temperature": 0, "max_new_tokens": 200, "ignore_eos": True})
        await asyncio.sleep(delay)
        stream = engine.stream(req)
        await anext(stream)
        await stream.aclose()

    results = await asyncio.wait_for(asyncio.gather(
        *(one(i, p, s) for i, (p, s) in enumerate(w)), aborted(0.0), aborted(0.02)), 60)
    outs = results[:len(w)]
    assert [o["output_ids"] for o in outs] == reference
    assert all(o["finish_reason"] == "length" for o in outs)
    pool_full(engine)
    assert not errors, errors[:3]
    stats = engine.get_stats()
    if name.startswith("small-pool"):  # the configuration really ran short of KV
        assert stats.retractions > 0
    assert (stats.forward_modes["MIXED"].batches > 0) == ("mixed" in name)
