"""RadixAttention in the running engine: same outputs with and without the cache, reuse across turns,
shrinking under KV pressure, and the accounting invariant after every test."""

from __future__ import annotations

import random

import pytest

from runtime import Engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


def _prompts(seed: int, n: int, shared: int, vocab: int = 390) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def _pool_full(e: Engine) -> bool:
    kv = e.scheduler.kv
    return kv.allocator.available_size() + kv.cache.evictable_size() == kv.size and kv.cache.protected_size() == 0


@pytest.fixture
def engines(tiny_llama):
    made = []

    def make(**kw):
        e = Engine(str(tiny_llama), device="cpu", **{"max_total_tokens": 4096, **kw})
        made.append(e)
        return e

    yield make
    for e in made:
        e.scheduler.check_kv_invariant()
        assert _pool_full(e)
        e.shutdown()


@pytest.mark.parametrize("extra", [{}, {"chunked_prefill_size": 8}, {"enable_mixed_chunk": True, "chunked_prefill_size": 16}])
def test_outputs_identical_with_and_without_cache(engines, extra):
    prompts = _prompts(1, 12, shared=40)
    on, off = engines(**extra), engines(disable_radix_cache=True, **extra)
    first = on.generate(input_ids=prompts[:2], sampling_params=GREEDY)  # warm the cache with two of them
    got_on = on.generate(input_ids=prompts, sampling_params=GREEDY)
    got_off = off.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in got_on] == [o["output_ids"] for o in got_off]
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in got_off[:2]]
    assert sum(o["usage"]["cached_tokens"] for o in got_on) >= 10 * 39
    assert all(o["usage"]["cached_tokens"] == 0 for o in got_off)


def test_outputs_identical_under_retraction(engines):
    prompts = _prompts(2, 8, shared=20)
    params = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
    small = engines(max_total_tokens=200)
    ref = engines(disable_radix_cache=True)
    got = small.generate(input_ids=prompts, sampling_params=params)
    want = ref.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert small.get_stats().retractions > 0


def test_multi_turn_chat_reuses_earlier_turns(engines, tiny_llama):
    e = engines()
    tok = e.tokenizer
    turn1 = [{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": "Hello world! How are you today?"}]
    ids1 = tok.apply_chat_template(turn1)
    out1 = e.generate(input_ids=ids1, sampling_params={"temperature": 0.0, "max_new_tokens": 10})
    turn2 = turn1 + [{"role": "assistant", "content": out1["text"]},
                     {"role": "user", "content": "The capital of France is?"}]
    ids2 = tok.apply_chat_template(turn2)
    out2 = e.generate(input_ids=ids2, sampling_params={"temperature": 0.0, "max_new_tokens": 10})
    # Everything up to the first turn's prompt is shared text; the cache must cover at least that.
    common = next((i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b), len(ids1))
    assert out2["usage"]["cached_tokens"] >= common - 1
    assert out2["usage"]["cached_tokens"] >= len(ids1) - 1
    stats = e.get_stats()
    assert stats.cache_hit_tokens >= len(ids1) - 1


def test_cache_shrinks_under_pressure_without_failing(engines):
    e = engines(max_total_tokens=160)
    rng = random.Random(3)
    for round_ in range(6):
        prompts = [[rng.randrange(3, 390) for _ in range(30)] for _ in range(3)]
        outs = e.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 8,
                                                              "ignore_eos": True})
        assert all(o["finish_reason"] == "length" for o in outs), round_
        e.scheduler.check_kv_invariant()
        assert e.get_stats().num_cached_tokens <= 160
    assert e.get_stats().evictions > 0
    # An idle server holds nothing for running requests, whatever it has cached.
    stats = e.get_stats()
    assert stats.num_used_tokens == 0 and stats.kv_usage_ratio == 0.0
    assert stats.num_cached_tokens > 0
