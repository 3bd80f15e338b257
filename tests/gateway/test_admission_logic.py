"""Admission without an engine: WaitEstimator turns real-looking SchedulerStats into rates and a wait
(prefill backlog, KV shortfall, full batch), AdmissionController refuses past --max-queue-wait-s or
--max-waiting-requests with a Retry-After from that estimate, counts what it admitted until the next
snapshot shows it, and admits when it knows nothing yet."""

from __future__ import annotations

import math

from runtime.gateway.admission import AdmissionController
from runtime.gateway.wait_estimator import WaitEstimator
from runtime.messages import ModeStats, SchedulerStats


def stats(*, prefill=(0, 0.0), decode=(0, 0.0), waiting_tokens=0, queue=0, running=0, used=0, total=10000,
          max_running=64, remaining=0) -> SchedulerStats:
    return SchedulerStats(
        forward_modes={"EXTEND": ModeStats(1, prefill[0], prefill[1]), "DECODE": ModeStats(1, decode[0], decode[1])},
        waiting_tokens=waiting_tokens, num_queue_reqs=queue, num_running_reqs=running, num_used_tokens=used,
        max_total_tokens=total, max_running_reqs=max_running, remaining_decode_tokens=remaining)


def test_rates_come_from_the_window_of_busy_time():
    est = WaitEstimator(window_s=10)
    est.observe(0.0, stats(prefill=(1000, 1.0), decode=(100, 1.0)))
    assert (est.prefill_tok_s, est.decode_tok_s) == (1000, 100)  # one snapshot: the totals
    est.observe(5.0, stats(prefill=(5000, 2.0), decode=(700, 3.0)))
    assert (est.prefill_tok_s, est.decode_tok_s) == (4000, 300)  # the window's deltas
    est.observe(6.0, stats(prefill=(5000, 2.0), decode=(700, 3.0)))  # idle: rates kept
    assert (est.prefill_tok_s, est.decode_tok_s) == (4000, 300)
    est.observe(7.0, stats(prefill=(10, 0.01), decode=(5, 0.05)))  # counters reset: a restarted engine
    assert (est.prefill_tok_s, est.decode_tok_s) == (1000, 100)


def test_wait_is_the_slowest_of_prefill_kv_and_slots():
    est = WaitEstimator()
    est.observe(0.0, stats(prefill=(2000, 1.0), decode=(500, 1.0)))
    w = est.estimate(stats(waiting_tokens=4000), prompt_tokens=100)
    assert math.isclose(w.wait_s, 2.0) and w.kv_s == 0 and w.slots_s == 0  # 4000 tokens at 2000/s
    # KV: 9000 of 10000 held by running requests with 1000 output tokens to go (2 s at 500/s): the queue
    # and this prompt need 2000, 1000 more than free, i.e. 1/9 of what the running set frees in 2 s.
    w = est.estimate(stats(waiting_tokens=1900, used=9000, running=8, remaining=1000), prompt_tokens=100)
    assert math.isclose(w.kv_s, 2.0 / 9) and math.isclose(w.wait_s, max(0.95, 2.0 / 9))
    # Slots: the batch is full (8 of 8) and 3 wait ahead: this one is the 4th to get a slot, half of 8.
    w = est.estimate(stats(queue=3, running=8, max_running=8, remaining=1000), prompt_tokens=10)
    assert math.isclose(w.slots_s, 2.0 * 4 / 8) and math.isclose(w.wait_s, 1.0)


def test_controller_refuses_with_retry_after_and_counts_admissions():
    ctl = AdmissionController(max_queue_wait_s=2.0, max_waiting_requests=100)
    assert ctl.decide([500], now=0.0) is None  # nothing known yet: admit
    ctl.observe(0.0, stats(prefill=(1000, 1.0), decode=(100, 1.0)))
    ctl._admitted.clear()
    assert ctl.decide([1500], now=0.1) is None  # 0 s ahead
    assert ctl.decide([400], now=0.2) is None  # 1.5 s ahead (the first, admitted since the snapshot)
    assert ctl.decide([100], now=0.3) is None  # 1.9 s ahead
    r = ctl.decide([100], now=0.4)  # 2.0 s ahead: not past the limit
    assert r is None
    r = ctl.decide([100], now=0.4)  # 2.1 s
    assert r is not None and r.reason == "queue_wait" and math.isclose(r.retry_after_s, 0.1)
    assert r.headers() == {"Retry-After": "1", "retry-after-ms": "100"}
    assert "at most 2 s" in r.message and "wait about 2.1 s" in r.message
    ctl.observe(0.5, stats(prefill=(1000, 1.0), decode=(100, 1.0), waiting_tokens=6000, queue=3))
    r = ctl.decide([10], now=0.6)  # the snapshot now holds them (admitted before it began: dropped)
    assert r is not None and math.isclose(r.retry_after_s, 4.0) and r.headers()["Retry-After"] == "4"


def test_controller_refuses_past_the_waiting_count():
    ctl = AdmissionController(max_queue_wait_s=100.0, max_waiting_requests=4)
    ctl.observe(0.0, stats(prefill=(1000, 1.0), decode=(100, 1.0), queue=3, waiting_tokens=3000))
    assert ctl.decide([10], now=0.1) is None  # 4th
    r = ctl.decide([10, 10], now=0.2)  # an n=2 request: 6 > 4
    assert r is not None and r.reason == "waiting_requests" and "4 requests waiting" in r.message
    assert math.isclose(r.retry_after_s, 3.01 * 2 / 4)  # 2 of the 4 ahead must start: half the 3.01 s backlog
