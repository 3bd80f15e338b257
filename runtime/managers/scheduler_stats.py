"""scheduler_stats: one Scheduler's SchedulerStats snapshot (/metrics, admission, the Ray client's least_load
routing), read on its thread or under its lock (SchedulerHost.stats)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.messages import SchedulerStats

if TYPE_CHECKING:
    from runtime.managers.scheduler import Scheduler


def scheduler_stats(s: Scheduler) -> SchedulerStats:
    kv = s.kv
    return SchedulerStats(
        num_running_reqs=len(s.running), num_queue_reqs=len(s.waiting),
        num_used_tokens=kv.held_by(s.live_reqs()) + kv.cache.protected_size(),
        num_cached_tokens=kv.cache.evictable_size(), max_total_tokens=kv.size,
        gen_throughput=s.gen_throughput, forward_modes=s.stats.snapshot(),
        retractions=s.stats.retractions, evictions=kv.evictions,
        cache_hit_tokens=s.prefill.cache_hit_tokens, cache_query_tokens=s.prefill.cache_query_tokens,
        device_busy_s=s.device_busy_s, overlap=s.overlap,
        waiting_tokens=sum(r.remaining_prefill for r in s.waiting), max_running_reqs=s.max_running,
        **s.stats.admission_fields(s.running, s.waiting, s.retractor.expected_new),
        **s.stats.iteration_fields(),
        **(s.spec.counters() if s.spec is not None else {}))
