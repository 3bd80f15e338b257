"""DeviceMemory (bench_offline's memory report): the allocator's peak counts on top of what the device uses
now, and what is neither pool nor weights is the memory a pool size must leave; CPU engines report None."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from benchmarks.device_memory import GIB, device_memory, summarize, tensor_bytes


def test_peak_and_headroom_from_byte_counts() -> None:
    got = summarize(total=80 * GIB, free=10 * GIB, reserved=68 * GIB, peak_reserved=71 * GIB,
                    peak_allocated=70 * GIB, pool=50 * GIB, weights=15 * GIB)
    assert got["used_now_gib"] == 70 and got["outside_torch_gib"] == 2
    assert got["peak_used_gib"] == 73  # 70 used now + 3 the allocator held at its peak and gave back
    assert got["other_peak_gib"] == 8 and got["headroom_gib"] == 7


def test_tensor_bytes_and_cpu_engine() -> None:
    assert tensor_bytes([torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.int64)]) == 64
    cpu = SimpleNamespace(worker=SimpleNamespace(runner=SimpleNamespace(device=torch.device("cpu"))))
    assert device_memory(cpu) is None and device_memory(object()) is None
