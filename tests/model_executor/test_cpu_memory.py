"""CpuMemoryTrimmer: freed heap memory goes back to the OS, operator settings win, and it can be off."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from runtime.model_executor.cpu_memory import CpuMemoryTrimmer, _glibc

glibc = _glibc()
needs_glibc = pytest.mark.skipif(glibc is None, reason="malloc_trim needs glibc")


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@needs_glibc
def test_trim_returns_freed_heap_pages_to_the_os():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, n = 64 * 1024, 3000  # below the mmap threshold: heap blocks, ~190 MiB touched
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks[:-1]:  # the last block pins the heap's top: only a trim can give the rest back
        libc.free(b)
    before = _rss_mib()
    t = CpuMemoryTrimmer(env={})
    t.trim()
    after = _rss_mib()
    libc.free(blocks[-1])
    assert t.trims == 1
    assert before - after > 100, (before, after)


@needs_glibc
def test_background_thread_trims_until_stopped():
    t = CpuMemoryTrimmer(interval_s=0.01, env={}).start()
    assert t.enabled and t._thread is not None and t._thread.is_alive()
    import time

    deadline = time.monotonic() + 5
    while t.trims < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    t.stop()
    assert t.trims >= 2 and t._thread is None


def test_off_switch_and_operator_settings():
    off = CpuMemoryTrimmer(env={"SHOAL_MALLOC_TRIM": "0"}).start()
    assert not off.enabled and off._thread is None
    off.trim()
    assert off.trims == 0
    own = CpuMemoryTrimmer(env={"MALLOC_TRIM_THRESHOLD_": "1048576"}).start()
    assert not own.enabled and own._thread is None  # the operator tuned malloc: no periodic trims


@needs_glibc
def test_a_failed_runner_build_leaves_no_trim_thread(tiny_llama, monkeypatch):
    """The trim thread starts once a ModelRunner is built: a build that fails (a Ray actor retrying, a bad
    flag) used to leave one thread per attempt waking forever."""
    import threading

    from runtime.config import ServerArgs
    from runtime.model_executor.model_runner import ModelRunner

    def trimmers() -> int:
        return sum(t.name == "shoal-malloc-trim" and t.is_alive() for t in threading.enumerate())

    def failing_load(self: ModelRunner, path: str) -> None:
        raise RuntimeError("weights unreadable")

    before = trimmers()
    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "_load_model", failing_load)
        with pytest.raises(RuntimeError, match="weights unreadable"):
            ModelRunner(ServerArgs(device="cpu", max_total_tokens=64), str(tiny_llama))
    assert trimmers() == before
    runner = ModelRunner(ServerArgs(device="cpu", max_total_tokens=64), str(tiny_llama))
    assert runner.memory_trimmer is not None and trimmers() == before + runner.memory_trimmer.enabled
    runner.release()
    assert trimmers() == before
