"""GcGuard: keeps Python's cyclic garbage collector from stalling a serving process.

Why: a full (generation 2) collection walks every tracked object in the process. After torch,
transformers, a model, its CUDA graphs and a tokenizer are loaded that is millions of objects, and one
collection stops the scheduler thread long enough to drain the GPU's queue: on an H100 serving the 8B
shape (benchmarks/bench_static_vs_continuous.py's workload, dummy weights) four ~12 ms decode steps
took 100-140 ms and the last one 436 ms, ~0.8 s of an 8.8 s run. `gc.freeze()` after start-up moves
everything alive then into a permanent generation that no collection visits again; objects made while
serving are still collected. SGLang and vLLM freeze after start-up for the same reason.

Collections that still take longer than `warn_s` are logged with their generation, so an operator sees
a stall the metrics alone would blame on the GPU. SHOAL_GC_FREEZE=0 keeps the start-up objects in the
collector (for measuring the difference) and leaves its thresholds alone.

Full collections are also made 10x rarer (generation 2 after 100 generation-1 collections, not 10): what
survives while serving is mostly requests' token lists, and a full walk visits every element of every list,
so its cost follows the tokens in flight, not the objects. On an H100 serving 1,000 x (1,000 in, 1,000 out)
generation 2 held ~28k objects (16.8k lists), yet 18 full collections took 57-95 ms each (2.1 s in all,
SHOAL_GC_PROFILE below) with nothing to collect. Young cycles are still freed at once; older ones later.
Prompts are held as tuples (GenerateRequest.input_ids, Req.origin_input_ids), which CPython stops tracking
once they survive a collection, so a full walk skips them: 500 requests of 1,000 prompt tokens in flight on
the CPU (benchmarks/bench_gc_walk.py, a tiny model) left 993k elements in the engine's tracked lists at the
peak before, 102k after (outputs and the last prefill batch), and a full collection took 6.5 ms before, 1.5
after (medians).

SHOAL_GC_PROFILE=1 also logs, for the first few slow collections,
how many objects each generation holds and the most common types among the oldest (what the walk visited)."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

DEFAULT_WARN_S = 0.05
FULL_EVERY = 100  # generation-1 collections between full ones while serving (CPython's default: 10)
PROFILED_SLOW = 3  # slow collections described under SHOAL_GC_PROFILE (each description walks the heap once)


@dataclass(slots=True)
class GcPauses:
    """Collections seen since the guard started (all generations), and the ones over the threshold."""
    collections: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    slow: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, seconds: float, slow: bool) -> None:
        with self._lock:
            self.collections += 1
            self.total_s += seconds
            self.max_s = max(self.max_s, seconds)
            self.slow += int(slow)


class GcGuard:
    """One per process that serves (the Engine's scheduler host, a Ray scheduler or TP worker actor, the
    gateway). start() freezes what start-up left alive and starts timing collections; stop() removes the
    timing callback and hands the frozen objects back to the collector: an engine shut down in a process
    that goes on (tests, benchmarks, the next Engine) must be collectable, or whatever of it sits in a
    reference cycle — tensors included — would never be freed. The cost is one full collection's walk,
    at shutdown."""

    def __init__(self, name: str, warn_s: float = DEFAULT_WARN_S):
        self.name = name
        self.warn_s = warn_s
        self.pauses = GcPauses()
        self.frozen = 0
        self._t0 = 0.0
        self._thresholds: tuple[int, int, int] | None = None  # the collector's own, while ours are set

    @staticmethod
    def freeze_enabled() -> bool:
        return os.environ.get("SHOAL_GC_FREEZE", "1") != "0"

    def start(self) -> GcGuard:
        if self.freeze_enabled():
            gc.collect()  # what is garbage now should not be frozen with the rest
            gc.freeze()
            self.frozen = gc.get_freeze_count()
            logger.debug("%s: froze %d start-up objects out of the garbage collector", self.name, self.frozen)
            if self._thresholds is None:  # a second start() must not take our thresholds for the collector's
                t0, t1, t2 = self._thresholds = gc.get_threshold()
                gc.set_threshold(t0, t1, max(t2, FULL_EVERY))
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)
        return self

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self.frozen:
            gc.unfreeze()  # process-wide: another live guard's objects rejoin too (one walk, then unfrozen)
            self.frozen = 0
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        seconds = time.perf_counter() - self._t0
        slow = seconds > self.warn_s
        self.pauses.add(seconds, slow)
        if slow:
            logger.warning("%s: a generation-%d garbage collection stopped this process for %.0f ms "
                           "(%d objects collected)", self.name, info.get("generation", -1), 1e3 * seconds,
                           info.get("collected", 0))
            if os.environ.get("SHOAL_GC_PROFILE", "0") == "1" and self.pauses.slow <= PROFILED_SLOW:
                logger.warning("%s: %s", self.name, describe_heap())


def describe_heap(top: int = 12) -> str:
    """Objects per generation and the most common types in generation 2 (and the frozen count)."""
    sizes = [len(gc.get_objects(generation=g)) for g in range(3)]
    kinds = Counter(type(o).__qualname__ for o in gc.get_objects(generation=2)).most_common(top)
    return (f"tracked objects by generation {sizes}, frozen {gc.get_freeze_count()}; generation 2's most "
            f"common types: " + ", ".join(f"{k} {n}" for k, n in kinds))
