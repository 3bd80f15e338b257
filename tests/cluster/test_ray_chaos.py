"""Chaos: DP=2 (tp=1) behind the HTTP gateway, 32 concurrent greedy SSE streams; the OS process of one
replica's scheduler actor (TP rank 0, the replica's only rank) is SIGKILLed mid-stream. Every stream
completes, its text identical to an undisturbed run (the moved ones continue on the other replica from
the tokens they had streamed: nothing missing, nothing repeated); the failovers show in /metrics; the
dead replica is relaunched and later requests (new prompts) use both replicas again; the KV pools end
free. benchmarks/bench_failover.py runs the scenario (shared code) and records it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_failover  # noqa: E402

pytestmark = pytest.mark.ray


def test_sigkill_a_replica_mid_stream(ray_local, tiny_llama):
    r = bench_failover.run(str(tiny_llama), n=32, max_tokens=24)
    assert r["mid_stream_at_kill"] > 0  # it died with streams half-way
    assert r["completed"] == 32 and r["identical_to_undisturbed"] == 32, r
    assert r["failovers"] >= 1 and r["failover_errors"] == 0
    assert r["metrics_failovers_line"] == f"shoal:failovers_total {float(r['failovers'])}"
    assert r["restarts"] == 1 and r["later_completed"] == 32
    assert all(n > 0 for n in r["later_prompt_tokens_per_replica"]), r  # both, the relaunched one included
    assert r["kv_free_after"]
