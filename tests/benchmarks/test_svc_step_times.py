"""svc_step_times on CPU: each SHOAL_GC_FREEZE setting runs in its own spawned interpreter and comes back
with every forward timed, grouped by mode and decode batch bucket, and the collector's numbers."""

from __future__ import annotations

import json

from benchmarks import svc_step_times


def test_summarize_buckets_and_slowest() -> None:
    rows = [("EXTEND", 3, 50.0), ("DECODE", 3, 5.0), ("DECODE", 40, 7.0), ("DECODE", 33, 9.0), ("DECODE", 1, 400.0)]
    s = svc_step_times.summarize(rows)
    assert s["modes"]["DECODE"]["forwards"] == 4 and abs(s["modes"]["DECODE"]["s"] - 0.421) < 1e-9
    assert list(s["decode_by_batch"]) == ["1-32", "33-64"]
    assert s["decode_by_batch"]["33-64"]["steps"] == 2 and s["decode_by_batch"]["33-64"]["mean_ms"] == 8.0
    assert s["slowest"][0] == {"index": 4, "mode": "DECODE", "batch": 1, "ms": 400.0}


class _Mark:
    """Stands in for a CUDA event: a device timestamp in ms."""

    def __init__(self, t: float):
        self.t = t

    def elapsed_time(self, later: _Mark) -> float:
        return later.t - self.t


def test_outside_forwards_splits_before_between_after() -> None:
    m = _Mark
    timed = [("EXTEND", 4, m(2.0), m(50.0)), ("EXTEND", 2, m(50.5), m(80.0)), ("DECODE", 6, m(83.0), m(90.0)),
             ("DECODE", 6, m(90.25), m(97.0))]
    r = svc_step_times.outside_forwards(timed, [m(0.0), m(100.0)])
    assert r["before_first_ms"] == 2.0 and r["after_last_ms"] == 3.0 and r["between_ms"] == 3.75
    assert r["between_by_pair_ms"] == {"DECODE->DECODE": 0.25, "EXTEND->DECODE": 3.0, "EXTEND->EXTEND": 0.5}
    assert r["largest"][0] == {"index": 2, "after": "EXTEND", "before": "DECODE", "ms": 3.0}


def test_cpu_run_freeze_on_and_off(tmp_path) -> None:
    out = tmp_path / "steps.json"
    res = svc_step_times.main(["--model-config", "Tiny-Llama-smoke", "--device", "cpu", "--dtype", "float32",
                               "--num-requests", "6", "--input-range", "4", "12", "--output-range", "2", "6",
                               "--output-file", str(out)])
    off, on = res["gc_freeze_0"], res["gc_freeze_1"]
    for r in (off, on):
        assert r["useful_tokens"] == r["expected_tokens"] > 0
        assert r["modes"]["EXTEND"]["forwards"] > 0 and r["modes"]["DECODE"]["forwards"] > 0
        assert len(r["forwards"]) == sum(m["forwards"] for m in r["modes"].values())
        assert r["gc_pause_s"] >= 0.0
    assert off["frozen_objects"] == 0 and on["frozen_objects"] > 1000
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "svc_step_times" and set(doc["results"]) == {"gc_freeze_0", "gc_freeze_1"}
