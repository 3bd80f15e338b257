"""TpProbe: what bench_tp measures around a Ray replica's timed bursts beyond the client's token stamps —
the TP followers' step traces (runtime/cluster/step_trace.py says what each number means), the
scheduler's own decode step period (from its DECODE stats: free of the client's stream delivery), and
each rank's CPU share while the replica idles (issue 13 item 6: at most 5% of a core)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


class TpProbe:
    def __init__(self, client: Any):
        import ray

        self.ray = ray
        self.workers = list(client.groups[0].workers) if hasattr(client, "groups") else []
        self.followers = self.workers[1:]

    def info(self) -> dict[str, Any]:
        if not self.followers:
            return {}
        return {"step_channel": self.ray.get(self.followers[0].step_channel.remote())}

    def start_burst(self) -> None:
        self.ray.get([f.trace_steps.remote(True) for f in self.followers])

    def end_burst(self) -> dict[str, Any] | None:
        """Rank 1's trace of the burst (the other followers' traces are stopped and dropped)."""
        traces = self.ray.get([f.trace_steps.remote(False) for f in self.followers])
        return traces[0] if traces else None

    def idle_cpu_share(self, seconds: float) -> list[float]:
        time.sleep(0.5)  # the last step's spin ends; then every rank should sleep
        return idle_cpu_share(self.ray.get([w.pid.remote() for w in self.workers]), seconds)


def engine_decode_step_s(before: Any, after: Any) -> float | None:
    """Mean decode step between two SchedulerStats: time between consecutive DECODE results / batches."""
    d0, d1 = before.forward_modes.get("DECODE"), after.forward_modes.get("DECODE")
    if d0 is None or d1 is None or d1.batches <= d0.batches:
        return None
    return (d1.time_s - d0.time_s) / (d1.batches - d0.batches)


def idle_cpu_share(pids: list[int], seconds: float) -> list[float]:
    """Each process's CPU time over `seconds` of wall time (1.0 = one busy core), from /proc."""
    def ticks(pid: int) -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    before = [ticks(p) for p in pids]
    time.sleep(seconds)
    hz = os.sysconf("SC_CLK_TCK")
    return [(ticks(p) - b) / hz / seconds for p, b in zip(pids, before)]


def tp2_summary(results: dict[str, Any], batch: list[int]) -> dict[str, float]:
    """Every TP=2 run's step against in-process TP=1, by the client's stamps and by the schedulers' own."""
    inproc, out = results.get("inproc", {}), {}
    for bs in batch:
        key = f"decode_step_ms_bs{bs}"
        for name, r in results.items():
            if not name.startswith("ray_tp2") or key not in r or key not in inproc:
                continue
            out[f"{name}_over_inproc_tp1_bs{bs}"] = r[key] / inproc[key]
            engine, base = r.get(f"engine_{key}"), inproc.get(f"engine_{key}")
            if engine and base:
                out[f"{name}_over_inproc_tp1_engine_bs{bs}"] = _median(engine) / _median(base)
    return out


def probe_rows(results: dict[str, Any], batch: list[int]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = [(f"{name} {k}", str([round(x, 2) for x in r[k]])) for name, r in results.items()
                                   for k in r if k.startswith("engine_decode_step_ms_bs")]
    rows += [(f"{name} bs{bs} {k} (median us)", v["median"]) for name, r in results.items() for bs in batch
             for t in r.get(f"step_trace_bs{bs}", [])[-1:] for k, v in t.items() if isinstance(v, dict)]
    rows += [(f"{name} idle CPU share per rank", str([round(x, 3) for x in r["idle_cpu_share_per_rank"]]))
             for name, r in results.items() if "idle_cpu_share_per_rank" in r]
    return rows


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]
