"""scheduler_stats: one Scheduler's SchedulerStats snapshot (/metrics, admission, the Ray client's least_load
routing), read on its thread or under its lock (SchedulerHost.stats)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.messages import LoraRequests, SchedulerStats

if TYPE_CHECKING:
    from runtime.managers.req import Req
    from runtime.managers.scheduler import Scheduler


def scheduler_stats(s: Scheduler) -> SchedulerStats:
    kv = s.kv
    live = s.live_reqs()
    return SchedulerStats(
        num_running_reqs=len(s.running), num_queue_reqs=len(s.waiting),
        num_used_tokens=kv.held_by(live) + kv.cache.protected_size(),
        num_cached_tokens=kv.cache.evictable_size(), max_total_tokens=kv.size,
        gen_throughput=s.gen_throughput, forward_modes=s.stats.snapshot(),
        retractions=s.stats.retractions, evictions=kv.evictions,
        cache_hit_tokens=s.prefill.cache_hit_tokens, cache_query_tokens=s.prefill.cache_query_tokens,
        device_busy_s=s.device_busy_s, overlap=s.overlap,
        waiting_tokens=sum(r.remaining_prefill for r in s.waiting), max_running_reqs=s.max_running,
        lora=lora_requests(s, live) if s.lora_ids.enabled else None,
        **s.stats.admission_fields(s.running, s.waiting, s.retractor.expected_new),
        **s.stats.iteration_fields(),
        **(s.spec.counters() if s.spec is not None else {}))


def lora_requests(s: Scheduler, live: list[Req]) -> LoraRequests:
    """The adapters of the requests holding KV (running, mid chunked prefill, in a batch in flight: vLLM's
    running) and of those queued, by the name each is served under now."""
    # A copy: loads and unloads change the registry's names from other threads.
    names = {lora_id: name for name, lora_id in s.lora_ids.names.copy().items()}

    def named(reqs: list[Req]) -> list[str]:
        return sorted({names[r.lora_id] for r in reqs if r.lora_id in names})

    return LoraRequests(max_loras=s.args.max_loras, running=named(live), waiting=named(s.waiting))
