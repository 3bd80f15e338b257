"""CpuMemoryTrimmer: keeps a CPU server's resident memory from creeping up under glibc malloc.

A CPU forward allocates and frees tensors of ever-changing sizes (prefill chunks, batch-sized logits).
glibc keeps freed memory in per-thread arenas and raises its mmap threshold as large blocks are freed, so
later large tensors come from the heap and leave holes: in a 35-minute soak of 200 streams
(benchmarks/bench_soak.py) the server's RSS grew from 1.4 GB to 3.1 GB, +9% after the first 5 minutes
(the rest of that growth was oneDNN's per-shape primitives: see cpu_linear.py). Two arenas (the scheduler
and the HTTP threads share them) and a malloc_trim(0) every few seconds (it returns free pages inside the
heaps too, through madvise) keep RSS at what is live. The mmap threshold is left to glibc: fixed at 1
MiB, a step's large tensors went back at once (RSS samples stopped swinging ~15% between trims) but every
prefill activation was freshly mapped and zero-filled, +10% on a 3.5k-token prefill step (decode steps
unchanged); operators who prefer the flat RSS set MALLOC_MMAP_THRESHOLD_=1048576. Settings the operator
made (MALLOC_ARENA_MAX, MALLOC_TRIM_THRESHOLD_) win; SHOAL_MALLOC_TRIM=0 turns it all off; without glibc
(musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time

logger = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt parameter numbers from glibc's malloc.h


class CpuMemoryTrimmer:
    def __init__(self, interval_s: float = 5.0, arenas: int = 2, env: dict[str, str] | None = None):
        env = os.environ if env is None else env
        self.interval_s = interval_s
        self.trims = 0
        self.trim_s = 0.0  # summed time spent in malloc_trim
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._libc = _glibc() if env.get("SHOAL_MALLOC_TRIM", "1") != "0" else None
        if self._libc is not None and "MALLOC_ARENA_MAX" not in env:
            self._libc.mallopt(_M_ARENA_MAX, arenas)
        self.enabled = self._libc is not None and "MALLOC_TRIM_THRESHOLD_" not in env

    def start(self) -> CpuMemoryTrimmer:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shoal-malloc-trim", daemon=True)
            self._thread.start()
        return self

    def trim(self) -> None:
        if self._libc is None:
            return
        t0 = time.perf_counter()
        self._libc.malloc_trim(0)
        self.trim_s += time.perf_counter() - t0
        self.trims += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.trim()


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        return libc
    except (OSError, AttributeError):  # not glibc: nothing to tune
        logger.debug("no glibc malloc_trim/mallopt; CPU memory trimming off")
        return None
