"""Admission never puts a stats() round trip on a request's way (on Ray stats() is an actor call that waits
for the step in progress, and the request's first token would wait with it): only the first request
waits, for the first snapshot; later ones are decided at once on the last snapshot while a stale one is
refreshed in the background, one stats() call at a time."""

from __future__ import annotations

import asyncio

from test_admission_logic import req, stats

from runtime.gateway.admission import AdmissionController


class SlowStatsClient:
    """An EngineClient as far as admission looks: stats() answers only when released."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = asyncio.Event()
        self.snapshot = stats(prefill=(1000, 1.0), decode=(100, 1.0))

    async def stats(self):
        self.calls += 1
        await self.release.wait()
        return self.snapshot


async def test_only_the_first_request_waits_for_stats():
    client = SlowStatsClient()
    ctl = AdmissionController(max_queue_wait_s=5.0, max_waiting_requests=2, refresh_s=0.0)
    first = asyncio.ensure_future(ctl.check(client, [req("a", 100)]))
    await asyncio.sleep(0.01)
    assert not first.done() and client.calls == 1  # no snapshot yet: the first one is worth the wait
    client.release.set()
    assert await first is None and ctl.stats is client.snapshot

    client.release.clear()
    client.snapshot = stats(prefill=(1000, 1.0), decode=(100, 1.0), queue=7)
    # Stale (refresh_s=0) and the engine slow to answer: decided at once on the last snapshot.
    assert await asyncio.wait_for(ctl.check(client, [req("b", 100)]), 0.5) is None
    refusal = await asyncio.wait_for(ctl.check(client, [req("c", 100)]), 0.5)
    assert refusal is not None and refusal.reason == "waiting_requests"  # a and b wait: the third is past 2
    assert client.calls == 2  # one refresh in flight, shared
    client.release.set()
    await asyncio.sleep(0.01)
    assert ctl.stats is client.snapshot and ctl.stats.num_queue_reqs == 7  # the next decision sees it
    ctl.loop_lag.stop()


async def test_a_failing_refresh_keeps_the_last_snapshot():
    client = SlowStatsClient()
    client.release.set()
    ctl = AdmissionController(max_queue_wait_s=5.0, max_waiting_requests=8, refresh_s=0.0)
    assert await ctl.check(client, [req("a", 100)]) is None
    kept = ctl.stats

    async def broken():
        raise ConnectionError("replica gone")

    client.stats = broken
    assert await ctl.check(client, [req("b", 100)]) is None
    await asyncio.sleep(0.01)
    assert ctl.stats is kept
    ctl.loop_lag.stop()
