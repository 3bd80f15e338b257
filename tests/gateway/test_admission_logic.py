"""Admission without an engine: WaitEstimator turns real-looking SchedulerStats into rates and a wait
(prefill backlog, KV shortfall, full batch), AdmissionController refuses past --max-queue-wait-s or
--max-waiting-requests with a Retry-After from that estimate, counts what it admitted until the next
snapshot shows it, and admits when it knows nothing yet."""

from __future__ import annotations

import math

from runtime.gateway.admission import AdmissionController
from runtime.gateway.wait_estimator import WaitEstimator
from runtime.messages import GenerateRequest, ModeStats, SchedulerStats
from runtime.sampling.params import SamplingParams


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


def test_wait_is_prefill_ahead_plus_room_to_start():
    est = WaitEstimator()
    est.observe(0.0, stats(prefill=(2000, 1.0), decode=(500, 1.0)))
    w = est.estimate(stats(waiting_tokens=4000), prompt_tokens=100)
    assert math.isclose(w.wait_s, 2.0) and w.kv_s == 0 and w.slots_s == 0  # 4000 tokens at 2000/s
    # KV: 9000 of 10000 held by 8 running requests with 1000 output tokens to go (2 s at 500/s); the queue
    # and this prompt need 1000 more than is free: one request (1125 tokens each) must finish, 1/8 of 2 s.
    w = est.estimate(stats(waiting_tokens=1900, used=9000, running=8, remaining=1000), prompt_tokens=100)
    assert math.isclose(w.kv_s, 0.25) and math.isclose(w.wait_s, 0.95 + 0.25)
    # Slots: the batch is full (8 of 8) and 3 wait ahead: 4 must finish, half the running set's 2 s.
    s3 = stats(queue=3, running=8, max_running=8, remaining=1000)
    s3.waiting_decode_tokens = 300
    w = est.estimate(s3, prompt_tokens=10)
    assert math.isclose(w.slots_s, 1.0) and math.isclose(w.wait_s, 1.0)
    # 10 ahead: all 8 running finish (2 s), then 3 queued ones of 100 tokens each (0.2 s apiece).
    s10 = stats(queue=10, running=8, max_running=8, remaining=1000)
    s10.waiting_decode_tokens = 1000
    assert math.isclose(est.estimate(s10, prompt_tokens=10).slots_s, 2.6)


def req(rid: str, n: int, max_new: int = 128) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=[1] * n, sampling_params=SamplingParams(max_new_tokens=max_new))


def test_controller_refuses_with_retry_after_and_counts_its_own_queue():
    ctl = AdmissionController(max_queue_wait_s=2.0, max_waiting_requests=100, min_retry_s=0.1)
    assert ctl.decide([req("x", 500)]) is None  # nothing known yet: admit
    ctl.started("x")
    ctl.observe(0.0, stats(prefill=(1000, 1.0), decode=(100, 1.0)))
    assert ctl.decide([req("a", 1500)]) is None  # nothing ahead
    assert ctl.decide([req("b", 400)]) is None  # 1.5 s ahead: a is counted the moment it is admitted
    assert ctl.decide([req("c", 100)]) is None  # 1.9 s
    assert ctl.decide([req("d", 100)]) is None  # 2.0 s: not past the limit
    r = ctl.decide([req("e", 100)])  # 2.1 s
    assert r is not None and r.reason == "queue_wait" and math.isclose(r.retry_after_s, 0.1)
    assert r.headers() == {"Retry-After": "1", "retry-after-ms": "100"}
    assert "at most 2 s" in r.message and "wait about 2.1 s" in r.message
    assert math.isclose(ctl.last_estimate.wait_s, 2.1)
    ctl.started("a")  # its first delta came back: it waits no more
    assert ctl.decide([req("e", 100)]) is None
    # A snapshot that says more is queued than this gateway sent (another client) wins.
    ctl.observe(0.5, stats(prefill=(1000, 1.0), decode=(100, 1.0), waiting_tokens=6000, queue=3))
    r = ctl.decide([req("f", 10)])
    assert r is not None and math.isclose(r.retry_after_s, 4.0) and r.headers()["Retry-After"] == "4"
    assert AdmissionController(2.0, 100).decide([req("g", 1)]) is None  # default floor is 1 s, when refusing


def test_controller_refuses_past_the_waiting_count():
    ctl = AdmissionController(max_queue_wait_s=100.0, max_waiting_requests=4, min_retry_s=0.1)
    ctl.observe(0.0, stats(prefill=(1000, 1.0), decode=(100, 1.0), queue=3, waiting_tokens=3000))
    assert ctl.decide([req("a", 10)]) is None  # 4th
    r = ctl.decide([req("b", 10), req("c", 10)])  # an n=2 request: 3 ahead + 2 > 4
    assert r is not None and r.reason == "waiting_requests" and "3 requests waiting" in r.message
    assert math.isclose(r.retry_after_s, 3.0 / 3)  # 1 of the 3 ahead must start: a third of the 3 s backlog


def test_estimates_learn_the_gap_to_the_waits_requests_saw():
    ctl = AdmissionController(max_queue_wait_s=2.0, max_waiting_requests=100, min_retry_s=0.1)
    ctl.observe(0.0, stats(prefill=(1000, 1.0), decode=(100, 1.0)))
    for i in range(8):  # each admitted 0.5 s of prefill behind the last, and each really waited 3x that
        ctl._waiting.clear()
        assert ctl.decide([req(f"w{i}", 500)]) is None and ctl.decide([req(f"x{i}", 10)]) is None
        admitted_at = ctl._waiting[f"x{i}"][2]
        ctl.started(f"w{i}", now=admitted_at)
        ctl.started(f"x{i}", now=admitted_at + 1.5)
    assert math.isclose(ctl.correction, 3.0)
    ctl._waiting.clear()
    ctl._starts.clear()  # Retry-After in the model's (corrected) seconds: no start rate measured
    r = ctl.decide([req("y", 1000)])  # 1.0 s by the model, 3.0 s as it learned
    assert r is None
    r = ctl.decide([req("z", 10)])
    assert r is not None and math.isclose(r.retry_after_s, 1.0) and ctl.last_estimate.correction == 3.0
