"""When a Ray Serve replica that Serve is stopping drains its gateway. With Serve's direct ingress on, Ray
2.60 keeps a stopping ingress replica reachable for RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S (30 s)
so load balancers can deregister it, then waits for its ongoing requests; the replica serves on through
that window and drains with what is left of graceful_shutdown_timeout_s. Before, it drained the moment
Serve set `_shutting_down`, so every request of the window got a 503 that nothing retried, and the budget
was read once at start (a config update was missed). Default mode (no direct ingress) drains at once.
A fake replica and Serve's constants module, patched: no live Ray."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private import constants  # noqa: E402

from runtime.entrypoints.ray_serve import (  # noqa: E402
    DIRECT_INGRESS_MIN_DRAINING_PERIOD_S,
    GRACEFUL_SHUTDOWN_TIMEOUT_S,
    TEARDOWN_RESERVE_S,
    DrainTiming,
    OrphanReport,
    ShoalDeployment,
    drain_grace_s,
    drain_timing,
)


def fake_replica(timeout_s: float, *, ingress: bool = True) -> SimpleNamespace:
    return SimpleNamespace(_shutting_down=False, _ingress=ingress,
                           _deployment_config=SimpleNamespace(graceful_shutdown_timeout_s=timeout_s))


@pytest.fixture
def direct_ingress(monkeypatch: pytest.MonkeyPatch) -> Any:
    def turn(on: bool, period_s: float = 30.0) -> None:
        monkeypatch.setattr(constants, "RAY_SERVE_ENABLE_DIRECT_INGRESS", on)
        monkeypatch.setattr(constants, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", period_s)
    return turn


@pytest.mark.parametrize(("timeout_s", "period_s", "hold_s", "stop_by_s"), [
    (30.0, 0.0, 0.0, 25.0),  # default mode: drain at once, streams run 25 s
    (35.0, 30.0, 30.0, 30.0),  # direct ingress, timeout at Serve's floor (period + 5): streams aborted at 30 s
    (60.0, 30.0, 30.0, 55.0),  # a timeout raised to period + 30: 25 s left for the streams after the window
    (20.0, 30.0, 25.0, 25.0),  # unfloored: force-kill at the period, so the window is cut by the reserve
    (3.0, 0.0, 0.0, 0.0),  # a budget below the reserve: abort at once
])
def test_the_timing_mirrors_serves_graceful_shutdown(timeout_s, period_s, hold_s, stop_by_s):
    timing = DrainTiming.of(timeout_s, period_s)
    assert (timing.hold_s, timing.stop_by_s) == (hold_s, stop_by_s)
    assert timing.grace_s(timing.hold_s) == stop_by_s - hold_s
    assert timing.grace_s(stop_by_s + 1) == 0.0


def test_the_period_counts_only_for_an_ingress_replica_with_direct_ingress_on(direct_ingress):
    direct_ingress(False)
    assert drain_timing(fake_replica(30.0)) == DrainTiming(hold_s=0.0, stop_by_s=25.0)
    assert drain_grace_s() == GRACEFUL_SHUTDOWN_TIMEOUT_S - TEARDOWN_RESERVE_S  # outside a replica
    direct_ingress(True, period_s=12.0)
    assert drain_timing(fake_replica(30.0)) == DrainTiming(hold_s=12.0, stop_by_s=25.0)
    assert drain_grace_s(fake_replica(30.0)) == 13.0
    assert drain_timing(fake_replica(30.0, ingress=False)) == DrainTiming(hold_s=0.0, stop_by_s=25.0)
    assert drain_timing(None).hold_s == 0.0  # outside a replica: nothing to hold open
    no_ingress_flag = SimpleNamespace(_shutting_down=False, _deployment_config=fake_replica(30.0)._deployment_config)
    assert drain_timing(no_ingress_flag).hold_s == 12.0  # ShoalDeployment is its app's ingress


def test_fallbacks_for_a_ray_without_the_fields(direct_ingress, monkeypatch):
    direct_ingress(True)
    assert drain_timing(SimpleNamespace(_ingress=True)).stop_by_s == GRACEFUL_SHUTDOWN_TIMEOUT_S - TEARDOWN_RESERVE_S
    monkeypatch.delattr(constants, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S")
    assert drain_timing(fake_replica(60.0)).hold_s == DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
    monkeypatch.delattr(constants, "RAY_SERVE_ENABLE_DIRECT_INGRESS")
    assert drain_timing(fake_replica(60.0)).hold_s == 0.0  # no direct ingress in that Ray


class FakeGateway:
    def __init__(self) -> None:
        self.stops: list[tuple[float, float]] = []  # (when, grace_s)

    def stop(self, grace_s: float) -> None:
        self.stops.append((time.monotonic(), grace_s))


def watched_replica(replica: SimpleNamespace) -> tuple[Any, threading.Thread]:
    """A ShoalDeployment without an engine: its watcher thread on the fake replica, its gateway a fake."""
    cls = ShoalDeployment.func_or_class
    deployment = cls.__new__(cls)
    deployment.gateway, deployment.client = FakeGateway(), SimpleNamespace(shutdown=lambda: None)
    deployment._orphans, deployment._closed = OrphanReport(), threading.Event()
    deployment._stop_lock, deployment._stopped = threading.Lock(), False
    watcher = threading.Thread(target=deployment._drain_when_stopped, daemon=True,
                               args=(lambda: replica._shutting_down, lambda: drain_timing(replica)))
    watcher.start()
    return deployment, watcher


def test_default_mode_drains_as_soon_as_serve_stops_the_replica(direct_ingress):
    direct_ingress(False)
    replica = fake_replica(30.0)
    deployment, watcher = watched_replica(replica)
    replica._deployment_config.graceful_shutdown_timeout_s = 9.0  # a config update after start counts
    began = time.monotonic()
    replica._shutting_down = True
    watcher.join(2)
    [(when, grace_s)] = deployment.gateway.stops
    assert when - began < 0.5 and 3.5 < grace_s <= 4.0
    deployment.__del__()
    assert len(deployment.gateway.stops) == 1  # __del__ does not drain a second time


def test_direct_ingress_serves_through_the_min_draining_period_then_drains_the_rest(direct_ingress):
    direct_ingress(True, period_s=0.5)
    replica = fake_replica(30.0)
    deployment, watcher = watched_replica(replica)
    replica._deployment_config.graceful_shutdown_timeout_s = 8.0
    began = time.monotonic()
    replica._shutting_down = True
    time.sleep(0.3)
    assert deployment.gateway.stops == []  # still serving: the load balancer may route here yet
    watcher.join(2)
    [(when, grace_s)] = deployment.gateway.stops
    assert 0.5 <= when - began < 1.0
    assert 2.0 < grace_s <= 2.5  # 8 s less the reserve, less the period (and the watcher's lag) spent
    deployment.__del__()


def test_del_during_the_period_stops_the_gateway_once(direct_ingress):
    direct_ingress(True, period_s=5.0)
    replica = fake_replica(40.0)
    deployment, watcher = watched_replica(replica)
    replica._shutting_down = True
    time.sleep(0.3)
    deployment.__del__()  # Serve's force-kill path or an interpreter exit: abort what runs, at once
    watcher.join(2)
    assert not watcher.is_alive()
    assert [grace_s for _, grace_s in deployment.gateway.stops] == [0.0]
