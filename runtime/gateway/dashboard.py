"""Dashboard: the numbers of the live status page (GET /dashboard/data, polled every second by the page).

Each poll takes one sample — the gateway's counters (finished choices, prompt and generated tokens) and
the engine's SchedulerStats, per replica where the client has several — and answers rates since the
previous sample, the forward-mode mix and prefix-cache hit rate over the samples of the last minutes,
the replicas' states, and the gateway's recent errors. Polls closer than _MIN_STEP_S apart (two pages
open) share one sample, so rates never divide by a few milliseconds."""

from __future__ import annotations

import logging
import time
from collections import deque

import msgspec

from runtime.engine_client import EngineClient
from runtime.gateway.error_log import ErrorEntry, ErrorLog
from runtime.gateway.metrics import GatewayMetrics
from runtime.messages import SchedulerStats

logger = logging.getLogger("shoal.gateway")

_WINDOW_S = 300.0  # the forward-mode mix and the cache hit rate cover the last 5 minutes
_MIN_STEP_S = 0.5
_HISTORY = 120  # throughput points kept for the page's chart (two minutes at one poll a second)


class ModeShare(msgspec.Struct, kw_only=True):
    mode: str  # ForwardMode name: EXTEND, DECODE, MIXED, ...
    batches: int
    tokens: int


class ReplicaView(msgspec.Struct, kw_only=True):
    index: int
    up: bool
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    tokens_per_s: float = 0.0  # tokens through its forward batches (prompt and generated) since the last sample


class ThroughputPoint(msgspec.Struct, array_like=True):
    at: float  # unix time
    requests_per_s: float
    generation_tokens_per_s: float


class DashboardData(msgspec.Struct, kw_only=True):
    model: str | None
    ready: bool
    uptime_s: float
    requests_total: int
    requests_per_s: float
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    running: int
    waiting: int
    batch_size: float  # requests per decode batch (one token each) since the previous sample
    kv_usage: float  # share of KV slots held by running requests
    kv_cache: float  # share held only by the evictable prefix cache
    cache_hit_rate: float | None  # prompt tokens found in the prefix cache / looked up, over the window
    window_s: float
    modes: list[ModeShare]
    replicas: list[ReplicaView]
    errors_total: int
    errors: list[ErrorEntry]
    history: list[ThroughputPoint]


class _Sample(msgspec.Struct, frozen=True):
    at: float  # monotonic
    totals: tuple[float, float, float]  # GatewayMetrics.totals()
    stats: SchedulerStats
    replicas: list[SchedulerStats | None]


class Dashboard:
    def __init__(self, metrics: GatewayMetrics, errors: ErrorLog):
        self.metrics = metrics
        self.errors = errors
        self.started = time.monotonic()
        self._samples: deque[_Sample] = deque()
        self._history: deque[ThroughputPoint] = deque(maxlen=_HISTORY)
        self._last: DashboardData | None = None

    async def data(self, client: EngineClient | None, model: str | None) -> DashboardData:
        now = time.monotonic()
        if self._last is not None and self._samples and now - self._samples[-1].at < _MIN_STEP_S:
            return self._last
        stats, replicas = await _engine_stats(client)
        sample = _Sample(now, self.metrics.totals(), stats, replicas)
        prev = self._samples[-1] if self._samples else None
        self._samples.append(sample)
        while len(self._samples) > 2 and now - self._samples[0].at > _WINDOW_S:
            self._samples.popleft()
        self._last = self._build(sample, prev, client is not None, model)
        return self._last

    def _build(self, cur: _Sample, prev: _Sample | None, ready: bool, model: str | None) -> DashboardData:
        dt = cur.at - prev.at if prev is not None else 0.0
        rates = [(c - p) / dt if dt > 0 else 0.0 for c, p in zip(cur.totals, prev.totals)] if prev else [0.0] * 3
        self._history.append(ThroughputPoint(time.time(), rates[0], rates[2]))
        oldest = self._samples[0]
        base = oldest.stats if oldest is not cur else SchedulerStats()
        s = cur.stats
        modes = _mode_deltas(s, base)
        decode = _mode_deltas(s, prev.stats if prev else SchedulerStats()).get("DECODE")
        hits, queries = s.cache_hit_tokens - base.cache_hit_tokens, s.cache_query_tokens - base.cache_query_tokens
        return DashboardData(
            model=model, ready=ready, uptime_s=cur.at - self.started, requests_total=int(cur.totals[0]),
            requests_per_s=rates[0], prompt_tokens_per_s=rates[1], generation_tokens_per_s=rates[2],
            running=s.num_running_reqs, waiting=s.num_queue_reqs,
            batch_size=decode.tokens / decode.batches if decode and decode.batches else 0.0,
            kv_usage=s.kv_usage_ratio, kv_cache=s.kv_cache_ratio,
            cache_hit_rate=hits / queries if queries > 0 else None, window_s=cur.at - oldest.at,
            modes=sorted(modes.values(), key=lambda m: -m.tokens), replicas=_replica_views(cur, prev, dt),
            errors_total=self.errors.total, errors=self.errors.recent(), history=list(self._history))


def _mode_deltas(cur: SchedulerStats, base: SchedulerStats) -> dict[str, ModeShare]:
    out = {}
    for mode, m in cur.forward_modes.items():
        b = base.forward_modes.get(mode)
        batches, tokens = m.batches - (b.batches if b else 0), m.tokens - (b.tokens if b else 0)
        if batches > 0:
            out[mode] = ModeShare(mode=mode, batches=batches, tokens=tokens)
    return out


def _forward_tokens(s: SchedulerStats | None) -> int:
    return sum(m.tokens for m in s.forward_modes.values()) if s is not None else 0


def _replica_views(cur: _Sample, prev: _Sample | None, dt: float) -> list[ReplicaView]:
    before = prev.replicas if prev is not None and len(prev.replicas) == len(cur.replicas) else []
    views = []
    for i, r in enumerate(cur.replicas):
        if r is None:
            views.append(ReplicaView(index=i, up=False))
            continue
        done = _forward_tokens(r) - _forward_tokens(before[i]) if before and before[i] is not None else 0
        views.append(ReplicaView(index=i, up=True, running=r.num_running_reqs, waiting=r.num_queue_reqs,
                                 kv_usage=r.kv_usage_ratio, tokens_per_s=max(done, 0) / dt if dt > 0 else 0.0))
    return views


async def _engine_stats(client: EngineClient | None) -> tuple[SchedulerStats, list[SchedulerStats | None]]:
    """The summed stats, and each replica's: the client's replica_stats where it has one (the Ray client:
    each replica or DP rank, None for one that is down), else its single engine's."""
    if client is None:
        return SchedulerStats(), []
    try:
        stats = await client.stats()
        per_replica = getattr(client, "replica_stats", None)
        return stats, list(await per_replica()) if callable(per_replica) else [stats]
    except Exception:  # the page must keep working while a replica is slow or gone
        logger.warning("could not read scheduler stats for the dashboard", exc_info=True)
        return SchedulerStats(), []
