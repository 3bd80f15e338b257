"""GcGuard: start-up objects leave the collector's reach, collections are timed, slow ones are logged, and
the scheduler's stats carry the totals."""

from __future__ import annotations

import gc
import logging
import re

import pytest

from runtime.gc_guard import GcGuard


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_start_freezes_what_is_alive_and_stop_removes_the_callback() -> None:
    keep = [_Node() for _ in range(100)]
    before = gc.get_threshold()
    guard = GcGuard("test")
    try:
        guard.start()
        assert guard.frozen >= len(keep) and gc.get_freeze_count() >= len(keep)
        assert guard._on_gc in gc.callbacks
        guard.start()  # idempotent: one callback per guard
        assert gc.callbacks.count(guard._on_gc) == 1
    finally:
        guard.stop()
    assert guard._on_gc not in gc.callbacks
    assert gc.get_threshold() == before  # the collector's own, given back after two starts
    assert gc.get_freeze_count() == 0  # handed back: a stopped engine's cycles can be collected


def test_collections_are_timed_and_slow_ones_logged(caplog: pytest.LogCaptureFixture) -> None:
    guard = GcGuard("test", warn_s=0.0)  # every collection counts as slow
    try:
        guard.start()
        for _ in range(10):
            _Node()
        with caplog.at_level(logging.WARNING, logger="runtime.gc_guard"):
            gc.collect()
    finally:
        guard.stop()
        gc.unfreeze()
    assert guard.pauses.collections >= 1 and guard.pauses.slow >= 1
    assert guard.pauses.total_s >= guard.pauses.max_s > 0.0
    assert any("generation-2 garbage collection" in r.getMessage() for r in caplog.records)


def test_profile_switch_describes_what_a_slow_collection_walked(caplog: pytest.LogCaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """SHOAL_GC_PROFILE=1: the first slow collections also log the generations' sizes and generation 2's
    most common types (here the 50,000 _Node objects kept alive and moved to generation 2: more than any
    type a test process holds, so they are among the most common whatever ran before)."""
    monkeypatch.setenv("SHOAL_GC_PROFILE", "1")
    kept = [_Node() for _ in range(50_000)]
    guard = GcGuard("test", warn_s=0.0)
    try:
        guard.start()
        gc.unfreeze()  # the kept nodes must stay visible to the collector
        with caplog.at_level(logging.WARNING, logger="runtime.gc_guard"):
            gc.collect()
    finally:
        guard.stop()
    described = [r.getMessage() for r in caplog.records if "most common types" in r.getMessage()]
    assert described and re.search(r"_Node (\d+)", described[0])
    assert int(re.search(r"_Node (\d+)", described[0]).group(1)) >= 50_000
    assert len(kept) == 50_000


def _full_collections_while_keeping(n_objects: int) -> int:
    """Generation-2 collections the collector itself starts while n_objects new objects stay alive."""
    full = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info.get("generation") == 2:
            full.append(1)

    kept: list[list[_Node]] = []
    gc.callbacks.append(count)
    try:
        for _ in range(n_objects // 1000):
            kept.append([_Node() for _ in range(1000)])
    finally:
        gc.callbacks.remove(count)
    return len(full)


def test_guard_makes_full_collections_rarer_and_gives_the_thresholds_back() -> None:
    """While a guard runs, the collector starts a full collection after 100 generation-1 collections (not
    10): the same allocations trigger far fewer of them; stop() restores the collector's thresholds."""
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults (a server guard started earlier in the suite may still run)
    gc.collect()
    gc.freeze()  # as the guard does: what the suite left alive would otherwise hold full collections back
    try:
        default_full = _full_collections_while_keeping(600_000)
    finally:
        gc.unfreeze()
    guard = GcGuard("test")
    try:
        guard.start()
        assert gc.get_threshold() == (700, 10, 100)
        guarded_full = _full_collections_while_keeping(600_000)
    finally:
        guard.stop()
        gc.unfreeze()
        restored = gc.get_threshold()
        gc.set_threshold(*before)
    assert restored == (700, 10, 10)
    assert default_full >= 3 and guarded_full <= default_full // 3, (default_full, guarded_full)


def test_switch_keeps_start_up_objects_in_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_GC_FREEZE", "0")
    gc.unfreeze()
    guard = GcGuard("test")
    try:
        guard.start()
        assert guard.frozen == 0 and gc.get_freeze_count() == 0
        gc.collect()
        assert guard.pauses.collections >= 1  # still timed
    finally:
        guard.stop()


def test_engine_freezes_start_up_and_reports_collections(tiny_llama) -> None:
    """The in-process Engine's scheduler host freezes start-up (model, tokenizer) and its stats carry the
    collections' time, which the benchmarks report beside each forward mode."""
    from runtime import Engine

    gc.unfreeze()
    engine = Engine(str(tiny_llama), dtype="float32", device="cpu", max_total_tokens=512)
    try:
        assert engine.host.gc.frozen > 1000 and gc.get_freeze_count() > 1000  # frozen ones can still die
        engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 3, "temperature": 0.0})
        gc.collect()
        stats = engine.get_stats()
        assert stats.gc_pause_s == engine.host.gc.pauses.total_s > 0.0
        assert stats.gc_slow_pauses == engine.host.gc.pauses.slow
    finally:
        engine.shutdown()
    assert engine.host.gc._on_gc not in gc.callbacks and gc.get_freeze_count() == 0


def test_a_shut_down_engine_is_collected(tiny_llama) -> None:
    """Freezing must not pin an engine that was shut down: its model is freed once nothing refers to it."""
    import weakref

    from runtime import Engine

    engine = Engine(str(tiny_llama), dtype="float32", device="cpu", max_total_tokens=512)
    model = weakref.ref(engine.worker.runner.model)
    engine.shutdown()
    del engine
    gc.collect()
    assert model() is None


def test_generate_folds_every_request_s_deltas_as_they_arrive(tiny_llama, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine.generate over many requests takes each delta as it arrives, not request by request: the short
    requests behind a long first one are folded (and their deltas freed) before the long one ends, so a
    1,000-request batch never holds every later request's deltas alive (~2M objects for 1,000 x 1,000
    tokens, for every collection to walk). Results keep the prompts' order and equal single-request runs."""
    from runtime import Engine
    from runtime.text.result_collector import ResultCollector

    order: list[tuple[str, bool]] = []
    add = ResultCollector.add

    def spy(self, o):
        order.append((o.rid, o.finished))
        return add(self, o)

    monkeypatch.setattr(ResultCollector, "add", spy)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    with Engine(str(tiny_llama), dtype="float32", device="cpu", max_total_tokens=2048) as engine:
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16]]
        params = [greedy | {"max_new_tokens": 40}] + [greedy | {"max_new_tokens": 3}] * 3
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert [len(o["output_ids"]) for o in outs] == [40, 3, 3, 3]
        long_rid = outs[0]["rid"]
        long_end = order.index((long_rid, True))
        short_ends = [order.index((o["rid"], True)) for o in outs[1:]]
        assert max(short_ends) < long_end, order
        for p, sp, o in zip(prompts, params, outs, strict=True):
            assert engine.generate(input_ids=p, sampling_params=sp)["output_ids"] == o["output_ids"]
        assert engine.get_stats().num_used_tokens == 0
