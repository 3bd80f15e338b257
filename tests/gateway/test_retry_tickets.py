"""RetryTickets and the AdmissionController's use of them, without an engine: a refusal books a slot
paced by the engine's start rate over the measured show-up rate; the same request returning at its slot
is admitted past the wait limit (fresh ones are still refused), returning early is told the rest of
its wait (or admitted if the queue has room anyway), and unclaimed tickets lapse and lower the show-up
rate, so a flood's one-shot clients do not push later promises out."""

from __future__ import annotations

import math

from test_admission_logic import req, stats

from runtime.gateway.admission import AdmissionController
from runtime.gateway.retry_tickets import RetryTickets


def test_slots_are_paced_by_start_rate_over_show_up():
    t = RetryTickets(bucket_s=0.5, grace_s=2.0, min_show_up=0.02)
    assert math.isclose(t.show_up, 0.1)  # prior: 1 in 10 come back
    # 0.8 starts/s x 0.5 s / 0.1 = 4 tickets a bucket: the first 4 at the earliest time, then the next bucket.
    delays = [t.book(("k", i), now=10.0, earliest_s=1.0, start_rate=0.8) for i in range(9)]
    assert delays[:4] == [1.0] * 4 and delays[4:8] == [1.5] * 4 and delays[8] == 2.0
    assert len(t) == 9
    # Nobody returns: past slot + grace every ticket lapses as a no-show, and the show-up rate falls.
    t.expire(20.0)
    assert len(t) == 0 and math.isclose(t.show_up, 0.02)  # floored: overbooking at most 50x
    assert [t.book(("n", i), now=20.0, earliest_s=1.0, start_rate=0.8) for i in range(20)] == [1.0] * 20


def test_claims_are_exact_early_or_lapsed():
    t = RetryTickets(bucket_s=0.5, grace_s=2.0, early_s=0.05, resolve_s=0.25)
    assert t.claim("a", 0.0) is None  # no ticket: a fresh request
    assert t.book("a", now=0.0, earliest_s=1.2, start_rate=0.0) == 1.2  # rate unknown: no pacing
    early = t.claim("a", 0.5)
    assert not early.admit and math.isclose(early.retry_after_s, 0.7) and len(t) == 1  # kept
    assert t.claim("a", 1.16).admit and len(t) == 0  # within early_s of the slot: used up
    shows = t.claimed
    t.book("b", now=0.0, earliest_s=1.0, start_rate=0.0)
    assert t.claim("b", 3.5) is None and t.claimed < shows  # past grace: lapsed, a no-show
    t.book("e", now=3.5, earliest_s=1.0, start_rate=0.0)
    t.expire(4.8)  # 0.3 s past its slot: counted as a no-show, still claimable
    shows, resolved = t.claimed, t.resolved
    assert t.claim("e", 5.4).admit and t.claimed == shows + 1 and t.resolved == resolved  # it came after all
    t.book("c", now=0.0, earliest_s=5.0, start_rate=0.0)
    assert t.claim("c", 1.0, early_ok=True).admit and len(t) == 0


def test_a_returning_request_gets_in_ahead_of_fresh_ones():
    ctl = AdmissionController(max_queue_wait_s=2.0, max_waiting_requests=100, min_retry_s=1.0)
    ctl.observe(0.0, stats(prefill=(1000, 1.0), decode=(100, 1.0)))
    assert ctl.decide([req("a", 2500)], now=0.0) is None  # 2.5 s queued
    r = ctl.decide([req("b", 500)], now=0.0)
    assert r is not None and math.isclose(r.retry_after_s, 1.0)  # 0.5 s past the limit, floored to 1 s
    r2 = ctl.decide([req("b2", 500)], now=0.5)  # the same request again, early: the rest of its wait
    assert r2 is not None and math.isclose(r2.retry_after_s, 0.5) and "reservation" in r2.message
    # At its slot the queue is as full as ever (fresh arrivals refilled it): the ticket holder gets in,
    # a fresh request of another prompt does not.
    assert ctl.decide([req("c", 400)], now=1.0) is not None
    assert ctl.decide([req("b3", 500)], now=1.0) is None
    assert ctl.decide([req("b4", 500)], now=1.0) is not None  # the ticket is used up
    r = ctl.decide([req("d", 300)], now=1.0)
    assert r is not None and r.retry_after_s >= 1.0
    # d comes back early, but the queue has drained: admitted without waiting for its slot.
    for rid in ("a", "b3"):
        ctl.started(rid, now=1.1)
    assert ctl.decide([req("d2", 300)], now=1.2) is None and len(ctl.tickets) == 2  # c and b4 hold theirs


def test_start_rate_is_measured_from_first_deltas():
    ctl = AdmissionController(max_queue_wait_s=2.0, max_waiting_requests=100, rate_window_s=5.0)
    ctl.observe(0.0, stats(prefill=(1000, 1.0), decode=(100, 1.0)))
    est = ctl.estimator.estimate(stats(queue=4, waiting_tokens=2000), 10)
    assert ctl.start_rate(4, est) == 2.0  # none measured: 4 ahead drain in the estimated 2 s
    for i in range(11):
        ctl._waiting[f"r{i}"] = (10, 10, 0.0, 0.0)
        ctl.started(f"r{i}", now=10.0 + 0.25 * i)
    assert math.isclose(ctl.start_rate(4, est), 4.0)  # 10 intervals over 2.5 s


def test_retry_after_is_the_queue_share_at_the_measured_start_rate():
    ctl = AdmissionController(max_queue_wait_s=2.0, max_waiting_requests=100, min_retry_s=0.1)
    ctl.observe(0.0, stats(prefill=(1000, 1.0), decode=(100, 1.0)))
    for i in range(11):  # 4 requests a second start
        ctl._waiting[f"r{i}"] = (10, 10, 0.0, 0.0)
        ctl.started(f"r{i}", now=10.0 + 0.25 * i)
    for i in range(5):  # 500 prompt tokens each at 1000/s: each waits 0.5 s more than the last, up to 2 s
        assert ctl.decide([req(f"q{i}", 500)], now=13.0) is None
    r = ctl.decide([req("y", 10)], now=13.0)  # 2.5 s by the model: 0.5/2.5 of the 5 ahead must start, at 4/s
    assert r is not None and math.isclose(r.retry_after_s, 0.5 / 2.5 * 5 / 4.0)
    assert math.isclose(r.retry_after_s, 0.25) and ctl.last_estimate.wait_s == 2.5


def test_an_early_holder_at_the_count_limit_keeps_its_one_ticket():
    ctl = AdmissionController(max_queue_wait_s=100.0, max_waiting_requests=1, min_retry_s=1.0)
    ctl.observe(0.0, stats(prefill=(1000, 1.0), decode=(100, 1.0)))
    assert ctl.decide([req("a", 10)], now=0.0) is None
    r = ctl.decide([req("b", 20)], now=0.0)
    assert r is not None and r.reason == "waiting_requests" and math.isclose(r.retry_after_s, 1.0)
    r = ctl.decide([req("b2", 20)], now=0.4)  # early: the rest of its wait, no second ticket
    assert r is not None and math.isclose(r.retry_after_s, 0.6) and len(ctl.tickets) == 1
    # Due, but the count is a hard bound: refused again, with a new ticket in place of the used one.
    r = ctl.decide([req("b3", 20)], now=1.0)
    assert r is not None and r.reason == "waiting_requests" and len(ctl.tickets) == 1
    ctl.started("a", now=1.5)
    assert ctl.decide([req("b4", 20)], now=2.0) is None and len(ctl.tickets) == 0


def test_promises_cover_the_trip_retries_measured():
    """Holders that claim late (the 429 out and the retry in were each delayed by a swamped HTTP layer)
    teach the tickets that delay; later promises add it, so sleeping the promise plus the same trip is
    within 2x of the promise."""
    t = RetryTickets(bucket_s=0.5, grace_s=30.0)
    for i in range(4):
        t.book(("k", i), now=0.0, earliest_s=1.0, start_rate=0.0)
        assert t.claim(("k", i), 2.8).admit  # 1.8 s past the slot
    assert math.isclose(t.return_delay_s, 1.8)
    t.book("early", now=0.0, earliest_s=5.0, start_rate=0.0)
    assert t.claim("early", 1.0, early_ok=True).admit and math.isclose(t.return_delay_s, 1.8)  # says nothing

    ctl = AdmissionController(max_queue_wait_s=2.0, max_waiting_requests=100, min_retry_s=1.0)
    ctl.tickets = t
    ctl.observe(0.0, stats(prefill=(1000, 1.0), decode=(100, 1.0)))
    assert ctl.decide([req("a", 2500)], now=0.0) is None
    r = ctl.decide([req("b", 500)], now=0.0)
    assert r is not None and math.isclose(r.retry_after_s, 1.0 + 1.8)
    assert math.isclose(ctl.last_estimate.trip_s, 1.8)
    seen = r.retry_after_s + 1.8  # slept the promise, then the same trip
    assert 0.5 <= r.retry_after_s / seen <= 2.0
    assert ctl.decide([req("b2", 500)], now=seen) is None  # and the ticket admits it


def test_loop_lag_before_any_return():
    """Before any holder came back, twice the event loop's recent lag stands for the trip."""
    ctl = AdmissionController(max_queue_wait_s=2.0, max_waiting_requests=100, min_retry_s=1.0)
    ctl.loop_lag.observe(10.0, 0.4)
    ctl.loop_lag.observe(10.5, 0.1)
    assert math.isclose(ctl.trip_s(10.6), 0.8)
    assert ctl.trip_s(13.0) == 0.0  # out of the window: the loop keeps up again


def test_loop_lag_sampler_measures_a_blocked_loop():
    import asyncio
    import time

    from runtime.gateway.loop_lag import LoopLag

    async def main() -> float:
        lag = LoopLag(interval_s=0.01, window_s=5.0)
        lag.ensure_started()
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # a handler hogging the loop
        await asyncio.sleep(0.05)
        lag.stop()
        return lag.recent_s()

    assert 0.2 <= asyncio.run(main()) < 2.0
