"""CpuConfig: what a CPU ModelRunner decides once at start — how many threads, which dtype — and logs.

Threads follow the cores the process is given: OMP_NUM_THREADS when set, else the smaller of the CPU
affinity mask (taskset, numactl, container cpusets) and the cgroup CPU quota (docker --cpus, k8s
limits); torch's default counts every core of the host, and threads beyond the quota are throttled
while holding OpenMP barriers.

dtype "auto": bf16 where the CPU has native bf16 math (AMX or AVX512_BF16: bf16 matmuls ~2x fp32's
FLOP/s and half the weight bytes), fp32 where it has not (bf16 then runs through conversions, slower
than fp32). auto never lowers a checkpoint's own precision: an fp32 checkpoint stays fp32, as auto means
on GPUs and in HF transformers (and the HF parity tests of tiny fp32 models keep comparing fp32)."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # in order of preference, as /proc/cpuinfo spells them


@dataclass(frozen=True, slots=True)
class CpuConfig:
    model_name: str  # the CPU, as /proc/cpuinfo names it
    bf16_isa: str | None  # the native bf16 instruction set found, None without one
    threads: int
    threads_from: str  # what decided the thread count

    @property
    def native_bf16(self) -> bool:
        return self.bf16_isa is not None

    def auto_dtype(self, checkpoint_dtype: torch.dtype) -> str:
        if checkpoint_dtype in (torch.bfloat16, torch.float16) and self.native_bf16:
            return "bfloat16"
        return "float32"


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str, set[str]]:
    try:
        text = path.read_text()
    except OSError:
        return "unknown CPU", set()
    name, flags = "unknown CPU", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == "unknown CPU":
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return name, flags


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Cores allowed by the cgroup CPU quota (rounded up), None when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # cgroup v2: "max 100000" or "200000 100000"
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return max(1, math.ceil(quota_us / period_us)) if quota_us > 0 else None
    except (OSError, ValueError):
        return None


def usable_threads(env: dict[str, str] | None = None, cgroup_root: Path = Path("/sys/fs/cgroup")
                   ) -> tuple[int, str]:
    env = os.environ if env is None else env
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    try:
        n, source = len(os.sched_getaffinity(0)), "CPU affinity"
    except (AttributeError, OSError):
        n, source = os.cpu_count() or 1, "cpu_count"
    quota = cgroup_cpu_limit(cgroup_root)
    if quota is not None and quota < n:
        return quota, "cgroup CPU quota"
    return n, source


def detect() -> CpuConfig:
    name, flags = _cpuinfo()
    isa = next((f for f in _BF16_FLAGS if f in flags), None)
    threads, source = usable_threads()
    return CpuConfig(model_name=name, bf16_isa=isa, threads=threads, threads_from=source)


def configure(requested_dtype: str, checkpoint_dtype: torch.dtype) -> str:
    """Sets torch's thread count and returns the dtype to load (requested unless "auto"); logs both."""
    cfg = detect()
    torch.set_num_threads(cfg.threads)
    dtype = cfg.auto_dtype(checkpoint_dtype) if requested_dtype == "auto" else requested_dtype
    why = (f"native bf16 ({cfg.bf16_isa})" if cfg.native_bf16 else "no native bf16 math") + \
        f", checkpoint {str(checkpoint_dtype).removeprefix('torch.')}"
    logger.info("CPU %s: %d threads (%s); dtype %s → %s (%s)", cfg.model_name, cfg.threads, cfg.threads_from,
                requested_dtype, dtype, why)
    return dtype


def prepare_model(model: torch.nn.Module) -> None:
    """CPU-only speedups applied once after the weights are loaded (both leave fp32 models alone)."""
    from runtime.model_executor.cpu_fused_layers import fuse_cpu_layers
    from runtime.model_executor.cpu_linear import pack_linear_weights

    pack_linear_weights(model)
    fuse_cpu_layers(model)
