"""SystemSampler: what the host and the GPU were doing while a benchmark's timed run ran.

Why: the same 8B workload (462/256 x 500, one H100) has read 29.8 to 39.5 req/s across processes and
machines, the slow runs with more device idle time (13% against 5%) and longer DECODE phases (issue 16
item 6); neither compiles inside the run nor Python's collector explained it. A run that samples the SM
clock, the throttle reasons, power and temperature, and the host's CPU use and steal time says which side
was slow instead of leaving it to guesses. A background thread samples every `interval` seconds:
/proc/stat and /proc/loadavg (Linux) and `nvidia-smi --query-gpu` where nvidia-smi exists; anything that
cannot be read is left out of the summary, never an error."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

GPU_FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "clocks_throttle_reasons.active",
              "utilization.gpu")
_GPU_KEYS = ("sm_clock_mhz", "mem_clock_mhz", "temp_c", "power_w", "throttle_reasons", "util_pct")


def parse_gpu_line(line: str) -> dict[str, Any] | None:
    """One `nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader,nounits` line → a dict; None if it
    does not have the fields (a driver that calls the throttle field differently prints an error)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(GPU_FIELDS):
        return None
    out: dict[str, Any] = {}
    for key, raw in zip(_GPU_KEYS, parts, strict=True):
        if key == "throttle_reasons":
            out[key] = raw
            continue
        try:
            out[key] = float(raw)
        except ValueError:
            out[key] = None  # "[N/A]" and the like
    return out


def visible_gpu_index() -> int:
    """nvidia-smi's index of the first GPU this process sees (CUDA_VISIBLE_DEVICES renumbers them)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def read_cpu_times(path: str = "/proc/stat") -> tuple[int, int, int] | None:
    """(busy, steal, total) jiffies of all CPUs since boot; None where /proc/stat is not there."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    v = [int(x) for x in fields[1:]]
    v += [0] * (8 - len(v))
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    return user + nice + system + irq + softirq, steal, user + nice + system + idle + iowait + irq + softirq + steal


def _stats(values: list[float]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}


@dataclass
class SystemSampler:
    interval: float = 1.0
    gpu_index: int | None = 0  # None: do not ask nvidia-smi
    gpu: list[dict[str, Any]] = field(default_factory=list)
    loadavg: list[float] = field(default_factory=list)
    _cpu0: tuple[int, int, int] | None = None
    _cpu1: tuple[int, int, int] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _t0: float = 0.0
    _t1: float = 0.0

    def __enter__(self) -> SystemSampler:
        self._cpu0 = read_cpu_times()
        self._t0 = time.perf_counter()
        self._smi = shutil.which("nvidia-smi") if self.gpu_index is not None else None
        self._thread = threading.Thread(target=self._run, name="system-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval + 5)
        self._cpu1 = read_cpu_times()
        self._t1 = time.perf_counter()

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval):
                return

    def _sample(self) -> None:
        try:
            with open("/proc/loadavg") as f:
                self.loadavg.append(float(f.read().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
        if self._smi is None:
            return
        try:
            out = subprocess.run([self._smi, f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits",
                                  "-i", str(self.gpu_index)], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            self._smi = None
            return
        row = parse_gpu_line(out.stdout.strip().splitlines()[0]) if out.returncode == 0 and out.stdout.strip() else None
        if row is None:
            self._smi = None  # fields this driver lacks: stop asking
            return
        self.gpu.append(row)

    def summary(self) -> dict[str, Any]:
        """What was seen: CPU busy and steal shares over the whole span, the load average, and each GPU
        field's min / median / max (the throttle reasons as the distinct masks seen)."""
        out: dict[str, Any] = {"span_s": round(self._t1 - self._t0, 3), "interval_s": self.interval,
                               "gpu_samples": len(self.gpu)}
        if self._cpu0 is not None and self._cpu1 is not None:
            busy, steal, total = (b - a for a, b in zip(self._cpu0, self._cpu1, strict=True))
            if total > 0:
                out["cpu_busy_pct"] = round(100.0 * busy / total, 2)
                out["cpu_steal_pct"] = round(100.0 * steal / total, 2)
        if self.loadavg:
            out["loadavg_1m"] = _stats(self.loadavg)
        if self.gpu:
            for key in _GPU_KEYS:
                if key == "throttle_reasons":
                    out["gpu_throttle_reasons_seen"] = sorted({r["throttle_reasons"] for r in self.gpu})
                else:
                    stats = _stats([r[key] for r in self.gpu])
                    if stats is not None:
                        out[f"gpu_{key}"] = stats
        return out
