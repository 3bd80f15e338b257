"""A failed step's order of events (runtime/managers/step_failure.py, step_health.py): when a step's failure makes
the engine unhealthy, the sink that delivers the failing request's error already sees it unhealthy (a reader on
another thread waits for that delivery, so on Ray the answer saying unhealthy carries those errors); a collect that
fails as a pause takes the batch in flight counts one failure, not two."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from collect_failure import fail_the_collect_a_pause_makes
from test_engine_health import GREEDY, PROMPT, STICKY, N, break_worker


def test_the_engine_is_unhealthy_before_the_failing_request_hears_its_error(make_engine, tiny_llama, monkeypatch):
    engine = make_engine(tiny_llama, watchdog_timeout=0)
    s = engine.scheduler
    assert s.watchdog.timeout_s is None
    seen: dict[str, Any] = {}
    sink = s.sink

    def delivering(outputs: list) -> None:
        if any(o.finished and o.finish_reason.kind == "error" for o in outputs) and "sink" not in seen:
            seen["sink"] = engine.health()  # the scheduler thread, delivering the error
            reader = threading.Thread(target=lambda: seen.setdefault("reader", (engine.health(), time.monotonic())))
            reader.start()  # another thread (the gateway's /health, a Ray actor's answer) waits for the delivery
            time.sleep(0.2)
            seen["delivered"] = time.monotonic()
            sink(outputs)
            seen["thread"] = reader
            return
        sink(outputs)

    monkeypatch.setattr(s, "sink", delivering)
    break_worker(engine, monkeypatch, STICKY)
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert out["finish_reason"] == "error" and "illegal memory access" in out["error"]
    assert not seen["sink"].healthy and "illegal memory access" in seen["sink"].reason
    seen["thread"].join(5)
    health, answered = seen["reader"]
    assert health == seen["sink"] and answered >= seen["delivered"]


def test_a_pause_whose_collect_fails_counts_one_failure(tiny_llama, monkeypatch, make_engine, hf_greedy):
    """pause_now's collect failure goes through fail_step once; SchedulerHost.call hands the error to the caller
    (run_forever never sees it), so the failure count is 1, not 2 (3 would run a probe)."""
    from runtime.managers import scheduler_host

    monkeypatch.setattr(scheduler_host, "overlap_wanted", lambda *a: True)  # CPU runs without overlap
    engine = make_engine(tiny_llama)
    s, out = engine.scheduler, {}
    assert s.overlap
    thread = threading.Thread(target=lambda: out.setdefault("r", engine.generate(
        input_ids=PROMPT, sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": 400})))
    thread.start()
    deadline = time.monotonic() + 10
    while not s.running and time.monotonic() < deadline:
        time.sleep(0.005)
    assert s.worker is engine.worker
    fail_the_collect_a_pause_makes(monkeypatch, s)
    for _ in range(50):
        try:
            engine.pause_generation("in_place")
        except RuntimeError as e:
            assert "device error in flight" in str(e)
            break
        engine.continue_generation()  # the pause found no batch in flight
    else:
        pytest.fail("no pause found a batch in flight")
    thread.join(15)
    assert not thread.is_alive() and out["r"]["finish_reason"] == "error"
    assert s.health.failed_in_a_row == 1 and engine.health().healthy and s.watchdog.started is None
    engine.continue_generation()
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == hf_greedy(PROMPT, N)
    assert s.health.failed_in_a_row == 0
