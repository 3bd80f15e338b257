"""GatewayMetrics: Prometheus metrics of one gateway app, in the app's own CollectorRegistry (two apps in
one process, as in tests, never share counters).

Latencies (TTFT, inter-token, end-to-end, queue) and token counters are measured in the gateway as
deltas stream through; each finished request's lengths, max_tokens and finish reason, and each prompt's n
and longest choice, as its choices end (ChoiceState). Scheduler gauges, cumulative counters and the steps
by tokens (shoal:iteration_tokens) come from EngineClient.stats(), fetched at scrape time by the /metrics
handler (stats() is async; collectors are not) and handed to a custom collector that turns that snapshot
into metric families. A request's client leaving counts it as aborted (Generation), as /abort_request does.

--metrics-compat (default vllm,sglang) also exposes, under vLLM's and SGLang's own names, types and labels,
the series of theirs that one of ours already measures (metrics_compat.py).

No `_created` series: one per counter and histogram, a start time Prometheus does not read (it finds counter
resets itself), dropped from this registry's output as it renders (_WithoutCreated; prometheus_client's
disable_created_metrics is process-wide and would take them from an embedding app's own metrics too). The
shoal:* series carry no model_name label, where vLLM's twins carry one: a server serves one model (its other
names are aliases), the name is known only once the engine is ready, and the vllm:* twins (on by default)
carry it for dashboards that select by it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from runtime.config import METRICS_COMPAT
from runtime.engine_client import RoutingStats
from runtime.gateway.metrics_compat import (
    HISTOGRAM_TWINS,
    LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    VLLM_N,
    CompatCollector,
    counter_value,
    cumulative_counts,
    iteration_buckets,
    system_of,
)
from runtime.gateway.wait_estimator import WaitEstimate
from runtime.messages import SchedulerStats

_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0)
_N_BUCKETS = (*VLLM_N, 50.0, 100.0)
# How a request can end (FinishReason.kind, a stop string the gateway saw counting as stop): each is shown
# from the start, at 0 until one ends so.
FINISH_REASONS = ("stop", "length", "abort", "error")


class _SchedulerStatsCollector(Collector):
    def __init__(self) -> None:
        self.stats: SchedulerStats | None = None
        self.replicas: list[SchedulerStats | None] = []

    def describe(self) -> Iterable[Metric]:
        return list(self._families(None, []))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(self.stats, self.replicas))

    @staticmethod
    def _families(s: SchedulerStats | None, replicas: list[SchedulerStats | None]) -> Iterable[Metric]:
        gauges = {
            "shoal:num_running_reqs": ("requests decoding now", lambda: s.num_running_reqs),
            "shoal:num_queue_reqs": ("requests waiting to be scheduled", lambda: s.num_queue_reqs),
            "shoal:kv_usage_ratio": ("share of KV slots held by running requests", lambda: s.kv_usage_ratio),
            "shoal:kv_cache_ratio": ("share of KV slots held only by the evictable prefix cache",
                                     lambda: s.kv_cache_ratio),
            "shoal:cache_hit_ratio": ("prompt tokens found in the prefix cache / prompt tokens looked up",
                                      lambda: s.cache_hit_tokens / max(s.cache_query_tokens, 1)),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc)
            if s is not None:
                g.add_metric([], float(value()))
            yield g
        batches = CounterMetricFamily("shoal:forward_batches", "forward batches run, by ForwardMode",
                                      labels=["mode"])
        tokens = CounterMetricFamily("shoal:forward_tokens", "tokens in forward batches, by ForwardMode",
                                     labels=["mode"])
        retractions = CounterMetricFamily("shoal:retractions", "requests retracted for lack of KV memory")
        evictions = CounterMetricFamily("shoal:cache_evictions", "tokens evicted from the prefix cache")
        # A collection stops the scheduler's process, and the GPU drains meanwhile (runtime/gc_guard.py).
        gc_seconds = CounterMetricFamily("shoal:scheduler_gc_pause_seconds",
                                         "time the scheduler processes spent in garbage collections")
        gc_slow = CounterMetricFamily("shoal:scheduler_gc_slow_pauses",
                                      "garbage collections in the scheduler processes over 50 ms")
        if s is not None:
            for mode, m in sorted(s.forward_modes.items()):
                batches.add_metric([mode.lower()], m.batches)
                tokens.add_metric([mode.lower()], m.tokens)
            retractions.add_metric([], s.retractions)
            evictions.add_metric([], s.evictions)
            gc_seconds.add_metric([], s.gc_pause_s)
            gc_slow.add_metric([], s.gc_slow_pauses)
        # vLLM's bounds: this is vllm:iteration_tokens_total (metrics_compat.py).
        steps = HistogramMetricFamily("shoal:iteration_tokens", "tokens of each engine step (a DP rank's idle "
                                      "steps not counted)")
        if s is not None:
            steps.add_metric([], iteration_buckets(s), sum_value=s.iteration_tokens_sum)
        yield from (batches, tokens, retractions, evictions, gc_seconds, gc_slow, steps)
        # Speculative decoding, per replica (or DP rank) and over all of them ("all").
        length = GaugeMetricFamily("shoal:spec_accept_length", "speculative decoding: mean tokens a request "
                                   "emits per verify step (accepted drafts + 1)", labels=["replica"])
        rate = GaugeMetricFamily("shoal:spec_accept_rate", "speculative decoding: accepted / proposed drafts",
                                 labels=["replica"])
        if s is not None:
            for name, r in [("all", s), *((str(i), r) for i, r in enumerate(replicas) if r is not None)]:
                length.add_metric([name], r.spec_accept_length)
                rate.add_metric([name], r.spec_accept_rate)
        yield from (length, rate)


class _AdmissionRoutingCollector(Collector):
    """The admission estimate (as of the last scrape) and a multi-replica client's failover counters."""

    def __init__(self) -> None:
        self.estimate: WaitEstimate | None = None
        self.routing: RoutingStats | None = None

    def describe(self) -> Iterable[Metric]:
        return []  # values appear only once known; nothing to pre-register

    def collect(self) -> Iterable[Metric]:
        e, r = self.estimate, self.routing
        if e is not None:
            for name, doc, v in (
                    ("shoal:estimated_queue_wait_seconds", "admission: estimated wait of a new request", e.wait_s),
                    ("shoal:prefill_rate_tokens_per_second", "admission: recent prefill rate (busy time)",
                     e.prefill_tok_s),
                    ("shoal:decode_rate_tokens_per_second", "admission: recent decode rate (busy time)",
                     e.decode_tok_s),
                    ("shoal:queue_wait_correction", "admission: waits requests saw / waits estimated",
                     e.correction),
                    ("shoal:retry_trip_seconds", "admission: how late retries arrive (added to Retry-After)",
                     e.trip_s),
                    ("shoal:admission_output_share", "admission: share of max_tokens that requests able to stop "
                     "early (EOS, stop) recently used; their output still to come counts at this share (1 until "
                     "one finishes)", e.output_share)):
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], v)
                yield g
        if r is not None:
            for name, doc, v in (
                    ("shoal:failovers", "in-flight requests moved to a live replica when theirs died", r.failovers),
                    ("shoal:failover_errors", "in-flight requests ended because no replica was left", r.failover_errors),
                    ("shoal:replica_restarts", "replica relaunches", r.restarts),
                    ("shoal:cache_aware_routed", "cache_aware routing decisions, by what decided", None)):
                if v is None:
                    c = CounterMetricFamily(name, doc, labels=["by"])
                    c.add_metric(["cache"], r.cache_routed)
                    c.add_metric(["load"], r.load_routed)
                else:
                    c = CounterMetricFamily(name, doc)
                    c.add_metric([], v)
                yield c
            g = GaugeMetricFamily("shoal:replica_inflight_requests", "requests in flight per replica",
                                  labels=["replica"])
            for i, n in enumerate(r.inflight):
                g.add_metric([str(i)], n)
            yield g
            up = GaugeMetricFamily("shoal:replica_up", "1 while a replica takes requests, 0 while it is down or "
                                   "relaunching", labels=["replica"])
            for i, alive in enumerate(r.alive):
                up.add_metric([str(i)], 1.0 if alive else 0.0)
            yield up


class _WithoutCreated(Collector):
    """A registry's families less their `<name>_created` samples (counters', histograms', summaries')."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            created = family.name + "_created"
            if any(s.name == created for s in family.samples):
                # A copy: a collector may hand out a family it keeps.
                kept = Metric(family.name, family.documentation, family.type, family.unit)
                kept.samples = [s for s in family.samples if s.name != created]
                family = kept
            yield family


class GatewayMetrics:
    def __init__(self, compat: Iterable[str] = METRICS_COMPAT, model_name: Callable[[], str | None] = lambda: None,
                 max_model_len: Callable[[], int | None] = lambda: None):
        """compat: the peers (vllm, sglang) whose names are exposed too (ServerArgs.metrics_compat_names);
        model_name: the served model's name at scrape time, for their model_name label (None: unknown);
        max_model_len: the context length (None: not known yet), vLLM's bound for max_tokens and for its
        histograms of token counts."""
        systems = tuple(compat)
        unknown = sorted(set(systems) - set(METRICS_COMPAT))
        if unknown:
            raise ValueError(f"unknown metrics compat {unknown[0]!r}: expected some of {', '.join(METRICS_COMPAT)}")
        self.max_model_len = max_model_len

        def buckets(attr: str, own: tuple[float, ...]) -> tuple[float, ...]:
            extra = (b for name, _, bounds in HISTOGRAM_TWINS[attr] if system_of(name) in systems for b in bounds)
            return tuple(sorted({*own, *extra}))

        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("shoal:time_to_first_token_seconds", "arrival at the gateway to first token",
                              buckets=buckets("ttft", LATENCY_BUCKETS), registry=r)
        self.itl = Histogram("shoal:inter_token_latency_seconds", "time between consecutive output tokens",
                             buckets=buckets("itl", _ITL_BUCKETS), registry=r)
        self.e2e = Histogram("shoal:e2e_request_latency_seconds", "arrival at the gateway to the last token",
                             buckets=buckets("e2e", LATENCY_BUCKETS), registry=r)
        self.queue_time = Histogram("shoal:queue_time_seconds", "time waiting in the scheduler queue",
                                    buckets=buckets("queue_time", LATENCY_BUCKETS), registry=r)
        self.prompt_tokens = Counter("shoal:prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("shoal:generation_tokens", "tokens generated", registry=r)
        # Per finished request (one choice: an engine request), as vLLM's finished_requests.
        self.request_prompt_tokens = Histogram("shoal:request_prompt_tokens", "prompt tokens of each finished "
                                               "request", buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("shoal:request_generation_tokens", "tokens each finished "
                                                   "request generated", buckets=TOKEN_BUCKETS, registry=r)
        self.request_max_tokens = Histogram("shoal:request_params_max_tokens", "max_tokens of each finished "
                                            "request, at most the context left after its prompt",
                                            buckets=TOKEN_BUCKETS, registry=r)
        self.requests_finished = Counter("shoal:requests_finished", "finished requests by how they ended "
                                         "(stop, length, abort, error)", ["reason"], registry=r)
        for reason in FINISH_REASONS:
            self.requests_finished.labels(reason)
        # Per prompt of a request, once its n choices all ended (vLLM's parent request).
        self.request_n = Histogram("shoal:request_params_n", "n of each finished request (per prompt)",
                                   buckets=_N_BUCKETS, registry=r)
        self.request_max_generation_tokens = Histogram(
            "shoal:request_max_num_generation_tokens", "the most tokens one of a prompt's n choices generated",
            buckets=TOKEN_BUCKETS, registry=r)
        self.rejected = Counter("shoal:requests_rejected", "requests refused with 429 (any reason)", registry=r)
        self.refusals = Counter("shoal:admission_refusals", "requests refused with 429, by reason "
                                "(queue_wait, waiting_requests, concurrent_requests)", ["reason"], registry=r)
        self.ignored_fields = Counter("shoal:ignored_request_fields", "request fields accepted and ignored, by path",
                                      ["field"], registry=r)
        self._stats = _SchedulerStatsCollector()
        r.register(self._stats)
        self._admission = _AdmissionRoutingCollector()
        r.register(self._admission)
        if systems:
            r.register(CompatCollector(self, systems, model_name))

    @property
    def scheduler_stats(self) -> SchedulerStats | None:
        """The engine's stats as of the last render (None: not ready)."""
        return self._stats.stats

    def observe_tokens(self, num_tokens: int, since_last_s: float | None) -> None:
        """A delta of num_tokens arrived since_last_s after the previous one (None: the first delta)."""
        if num_tokens <= 0:
            return
        self.generation_tokens.inc(num_tokens)
        # A delta may carry several tokens (the engine coalesces what piled up): spread its gap over
        # them; tokens that came with the first one reached the client together with it (gap 0).
        gaps = num_tokens - 1 if since_last_s is None else num_tokens
        per_token = 0.0 if since_last_s is None else since_last_s / num_tokens
        for _ in range(gaps):
            self.itl.observe(per_token)

    def finished(self, prompt_tokens: int, generated: int, max_tokens: int | None, reason: str) -> None:
        """One request (a choice) ended: its prompt and output lengths, its max_tokens (None or 0: none to
        count, as vLLM skips a falsy one) and how it ended."""
        self.prompt_tokens.inc(prompt_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated)
        context = self.max_model_len()
        if max_tokens and context is not None:
            # vLLM's is what the request could get (get_max_tokens); ours may ask past the context, which the
            # scheduler clips.
            max_tokens = min(max_tokens, context - prompt_tokens)
        if max_tokens is not None and max_tokens > 0:
            self.request_max_tokens.observe(max_tokens)
        self.requests_finished.labels(reason).inc()

    def finished_prompt(self, n: int, max_generated: int) -> None:
        """The n choices of one prompt all ended; the longest generated max_generated tokens."""
        self.request_n.observe(n)
        self.request_max_generation_tokens.observe(max_generated)

    def totals(self) -> tuple[float, float, float]:
        """(choices finished, prompt tokens of finished choices, tokens generated) since the app started."""
        # From the metrics themselves: the registry's get_sample_value would build every family, the
        # scheduler's and the compat ones included, for three numbers.
        return (cumulative_counts(self.e2e)[1][float("inf")], counter_value(self.prompt_tokens),
                counter_value(self.generation_tokens))

    def refused(self, reason: str) -> None:
        self.rejected.inc()
        self.refusals.labels(reason).inc()

    def render(self, stats: SchedulerStats | None, estimate: WaitEstimate | None = None,
               routing: RoutingStats | None = None, replicas: list[SchedulerStats | None] | None = None) -> bytes:
        """Prometheus text exposition; stats None (engine not ready) leaves the scheduler families empty.
        replicas: each replica's (or DP rank's) own stats, for the per-replica families."""
        self._stats.stats, self._stats.replicas = stats, replicas or []
        self._admission.estimate, self._admission.routing = estimate, routing
        return generate_latest(_WithoutCreated(self.registry))
