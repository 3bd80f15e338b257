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
collector (for measuring the difference)."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

DEFAULT_WARN_S = 0.05


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

    @staticmethod
    def freeze_enabled() -> bool:
        return os.environ.get("SHOAL_GC_FREEZE", "1") != "0"

    def start(self) -> GcGuard:
        if self.freeze_enabled():
            gc.collect()  # what is garbage now should not be frozen with the rest
            gc.freeze()
            self.frozen = gc.get_freeze_count()
            logger.debug("%s: froze %d start-up objects out of the garbage collector", self.name, self.frozen)
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)
        return self

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self.frozen:
            gc.unfreeze()  # process-wide: another live guard's objects rejoin too (one walk, then unfrozen)
            self.frozen = 0

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
