"""benchmarks/system_sampler.py: the nvidia-smi line parser on a real line's shape and on what a driver
without a field prints, /proc/stat's CPU times, and a sampler run on this machine (CPU busy share and the
load average seen, no GPU fields without nvidia-smi, nothing raised), and bench_offline's JSON carrying it."""

from __future__ import annotations

import shutil
import time

import pytest

from benchmarks.system_sampler import SystemSampler, parse_gpu_line, read_cpu_times


def test_parse_gpu_line() -> None:
    row = parse_gpu_line("1980, 2619, 45, 350.12, 0x0000000000000000, 97")
    assert row == {"sm_clock_mhz": 1980.0, "mem_clock_mhz": 2619.0, "temp_c": 45.0, "power_w": 350.12,
                   "throttle_reasons": "0x0000000000000000", "util_pct": 97.0}
    assert parse_gpu_line("1980, [N/A], 45, 350.12, 0x4, 97")["mem_clock_mhz"] is None
    assert parse_gpu_line('Field "clocks_throttle_reasons.active" is not a valid field to query.') is None


def test_cpu_times(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 50 1000 20 1 2 7 0 0\ncpu0 1 2 3 4\n")
    assert read_cpu_times(str(stat)) == (100 + 5 + 50 + 1 + 2, 7, 100 + 5 + 50 + 1000 + 20 + 1 + 2 + 7)
    assert read_cpu_times(str(tmp_path / "missing")) is None


@pytest.mark.skipif(read_cpu_times() is None, reason="needs Linux /proc/stat")
def test_sampler_on_this_machine() -> None:
    with SystemSampler(interval=0.05) as s:
        end = time.perf_counter() + 0.4
        while time.perf_counter() < end:  # keep a core busy
            sum(range(1000))
    out = s.summary()
    assert 0.3 < out["span_s"] < 5
    assert out["cpu_busy_pct"] > 0 and 0 <= out["cpu_steal_pct"] <= 100
    assert out["loadavg_1m"]["max"] >= 0
    if shutil.which("nvidia-smi") is None:
        assert out["gpu_samples"] == 0 and not any(k.startswith("gpu_") and k != "gpu_samples" for k in out)


@pytest.mark.skipif(read_cpu_times() is None, reason="needs Linux /proc/stat")
def test_bench_offline_reports_the_system_during_its_run(tmp_path) -> None:
    from benchmarks import bench_offline

    out = tmp_path / "offline.json"
    # Long enough for /proc/stat's clock ticks (10 ms) to move: 4 x 4 tokens once finished in 0.01 s, and a
    # span without a tick has no CPU shares to report.
    results = bench_offline.main(["--model-config", "Tiny-Llama-smoke", "--device", "cpu", "--dtype", "float32",
                                  "--num-prompts", "8", "--input-len", "8", "--output-len", "64",
                                  "--output-file", str(out)])
    system = results["system_during_run"]
    assert system["span_s"] > 0 and 0 <= system["cpu_busy_pct"] <= 100
    assert '"system_during_run"' in out.read_text()
    assert results["device_memory"] is None and results["total_output_tokens"] == 8 * 64  # CPU: no device report
