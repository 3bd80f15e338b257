"""Chunked prefill and MIXED batches change how prompts are split across steps, never the tokens."""

from __future__ import annotations

import random

import pytest

from runtime.messages import BatchResult, WorkerBatch
from runtime.model_executor.forward_mode import ForwardMode

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def long_prompts(n: int = 4, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 399) for _ in range(rng.randint(90, 110))] for _ in range(n)]


@pytest.fixture(scope="module")
def unchunked(tiny_llama) -> list[list[int]]:
    from runtime import Engine

    with Engine(str(tiny_llama), device="cpu", max_total_tokens=4096, chunked_prefill_size=-1,
                disable_radix_cache=True, log_level="warning") as e:
        return [o["output_ids"] for o in e.generate(input_ids=long_prompts(), sampling_params=GREEDY)]


@pytest.mark.parametrize("chunk", [4, 16, 64])
@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["cache", "nocache"])
def test_chunk_sizes_give_identical_outputs(make_engine, tiny_llama, unchunked, monkeypatch, chunk: int,
                                            disable_radix_cache: bool):
    prompts = long_prompts()
    engine = make_engine(tiny_llama, chunked_prefill_size=chunk, disable_radix_cache=disable_radix_cache)
    sizes: list[tuple[int, int]] = []  # (forward mode, tokens) of every step the worker ran
    run_batch = engine.worker.run_batch

    def spy(batch: WorkerBatch) -> BatchResult:
        sizes.append((batch.forward_mode, len(batch.input_ids)))
        return run_batch(batch)

    monkeypatch.setattr(engine.worker, "run_batch", spy)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == unchunked
    extend_sizes = [n for mode, n in sizes if mode == ForwardMode.EXTEND]
    assert max(extend_sizes) == chunk
    modes = engine.get_stats().forward_modes
    # No prefill step goes over the chunk (a step may finish one prompt and start the next).
    assert modes["EXTEND"].batches >= -(-sum(len(p) for p in prompts) // chunk)
    assert modes["EXTEND"].tokens == sum(len(p) for p in prompts)
    assert modes["MIXED"].batches == 0


def test_max_prefill_tokens_budget_chunks_too(make_engine, tiny_llama, unchunked):
    """A prefill budget smaller than the prompt chunks it like chunked_prefill_size does."""
    engine = make_engine(tiny_llama, max_prefill_tokens=32, chunked_prefill_size=-1)
    outs = engine.generate(input_ids=long_prompts(), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == unchunked


@pytest.mark.parametrize("chunk", [16, 64])
def test_mixed_chunk_on_and_off_identical(make_engine, tiny_llama, unchunked, chunk: int):
    prompts = long_prompts()
    results = {}
    for mixed in (False, True):
        engine = make_engine(tiny_llama, chunked_prefill_size=chunk, enable_mixed_chunk=mixed)
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        results[mixed] = [o["output_ids"] for o in outs]
        modes = engine.get_stats().forward_modes
        if mixed:
            # Later prompts' chunks ran together with the decodes of the earlier ones.
            assert modes["MIXED"].batches > 0
            assert modes["MIXED"].tokens > modes["MIXED"].batches
        else:
            assert modes["MIXED"].batches == 0
        # Prompt tokens and decode tokens, however they were grouped, add up the same.
        total = sum(m.tokens for m in modes.values())
        assert total == sum(len(p) for p in prompts) + sum(len(o) - 1 for o in results[mixed])
    assert results[True] == results[False] == unchunked
