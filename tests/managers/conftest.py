"""Fixtures for the scheduler / in-process Engine tests: engines on the tiny fp32 checkpoints that are
always shut down, and the KV-pool check every test ends with (nothing leaked, nothing left locked)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import Engine

# Engines the tests build share these unless a test overrides them: a pool big enough that only the
# retraction tests ever run short, and the slow-but-exact fp32 path of the tiny models.
BASE_ENGINE_KWARGS: dict[str, Any] = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096,
                                      "log_level": "warning"}  # HF parity is checked in fp32


def wait_idle(engine: Engine, timeout_s: float = 10.0) -> None:
    """Waits until the scheduler holds no request and its inbox is empty, seen on several polls in a row
    (the idle loop briefly takes an inbox item out and puts it back, so one look is not enough)."""
    s = engine.scheduler
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while time.monotonic() < deadline:
        with s.lock:
            idle = not s.has_work() and not s.reqs and s.inbox.empty()
        quiet = quiet + 1 if idle else 0
        if quiet >= 5:
            return
        time.sleep(0.01)
    raise AssertionError(f"scheduler still busy after {timeout_s} s: waiting={len(s.waiting)} "
                         f"running={len(s.running)} reqs={list(s.reqs)}")


def assert_pool_full(engine: Engine) -> None:
    """Every KV slot is free or evictable cache, no cache node is locked, every table row is free."""
    wait_idle(engine)
    s = engine.scheduler
    with s.lock:
        s.check_kv_invariant()
        kv = s.kv
        assert kv.cache.protected_size() == 0, "a finished request left its cache prefix locked"
        if kv.enabled:
            assert kv.allocator.available_size() + kv.cache.evictable_size() == kv.size
        else:
            assert kv.cache.total_size() == 0
            assert kv.allocator.available_size() == kv.size
        assert kv.req_slots.available_size() == kv.req_slots.size, "a request table row leaked"
        assert s.chunked_req is None and not s.running and not s.waiting
    assert engine.get_stats().num_used_tokens == 0
    assert not engine._consumers, f"output consumers leaked: {list(engine._consumers)}"


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Engine]]:
    """Builds engines (BASE_ENGINE_KWARGS + overrides); at teardown checks each pool is full, then shuts
    them all down."""
    engines: list[Engine] = []

    def make(model_path: Path | str, **kwargs: Any) -> Engine:
        e = Engine(str(model_path), **{**BASE_ENGINE_KWARGS, **kwargs})
        engines.append(e)
        return e

    yield make
    try:
        for e in engines:
            if e.is_ready():
                assert_pool_full(e)
    finally:
        for e in engines:
            e.shutdown()


@pytest.fixture
def pool_full() -> Callable[[Engine], None]:
    """assert_pool_full, for tests that check mid-way (test modules cannot import a conftest)."""
    return assert_pool_full


@pytest.fixture(scope="module")
def shared_engine(tiny_llama: Path) -> Iterator[Engine]:
    """One default engine (prefix cache on) for tests that only need a working engine."""
    e = Engine(str(tiny_llama), **BASE_ENGINE_KWARGS)
    yield e
    e.shutdown()


@pytest.fixture
def engine(shared_engine: Engine) -> Iterator[Engine]:
    """The shared engine, checked to be back to a full pool after the test."""
    assert_pool_full(shared_engine)
    yield shared_engine
    assert_pool_full(shared_engine)


@pytest.fixture(scope="module")
def hf_llama(tiny_llama: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_llama: Any) -> Callable[[list[int], int], list[int]]:
    """Greedy continuation computed by HF transformers with a full forward per token (no EOS stop)."""

    @torch.inference_mode()
    def run(prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            logits = hf_llama(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        return ids[len(prompt):]

    return run


@pytest.fixture(scope="module")
def hf_logprobs(hf_llama: Any) -> Callable[[list[int], list[int]], torch.Tensor]:
    """log_softmax of HF's logits at each output position: row i is the distribution of output[i]."""

    @torch.inference_mode()
    def run(prompt: list[int], output: list[int]) -> torch.Tensor:
        logits = hf_llama(torch.tensor([prompt + output])).logits[0].float()
        return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(output) - 1], dim=-1)

    return run
