"""GatewayMetrics: Prometheus metrics of one gateway app, in the app's own CollectorRegistry (two apps in
one process, as in tests, never share counters).

Latencies (TTFT, inter-token, end-to-end, queue) and token counters are measured in the gateway as
deltas stream through. Scheduler gauges and cumulative counters come from EngineClient.stats(), fetched
at scrape time by the /metrics handler (stats() is async; collectors are not) and handed to a custom
collector that turns that snapshot into metric families.

--metrics-compat (default vllm,sglang) also exposes, under vLLM's and SGLang's own names, types and labels,
the series of theirs that one of ours already measures, so dashboards, alerts and autoscalers (KEDA/HPA,
the Gateway API Inference Extension's endpoint picker) written for them keep working. They are read from
ours at scrape time (_CompatCollector), never observed twice on the token path; our histograms carry the
union of the bucket bounds, so each of theirs is ours read at its own bounds, exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from runtime.config import METRICS_COMPAT
from runtime.gateway.wait_estimator import WaitEstimate
from runtime.messages import RoutingStats, SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0)
# The peers' own bounds (vllm/v1/metrics/loggers.py PrometheusStatLogger; sglang/srt/metrics/collector.py
# TokenizerMetricsCollector and SchedulerMetricsCollector defaults).
_VLLM_TTFT = (*_LATENCY_BUCKETS, 640.0, 2560.0)
_VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0)
_VLLM_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
_SGL_TTFT = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0)
_SGL_E2E = (*_SGL_TTFT, 600.0, 1200.0, 1800.0, 2400.0)
_SGL_ITL = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4,
            0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)
_SGL_QUEUE = (0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0,
              90.0, 100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0, 900.0, 1000.0, 1200.0, 1400.0,
              1600.0, 1800.0, 2000.0, 2500.0, 3000.0)

# Each peer's label names and, for a whole server (its replicas and DP ranks summed, as ours are), their
# values: vLLM's PrometheusStatLogger (engine: the EngineCore index); SGLang's scheduler collector (one
# TP/PP rank 0 of a "unified" engine) and its tokenizer collector. Label values come after the model name.
_LABELS: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = MappingProxyType({
    "vllm": (("model_name", "engine"), ("0",)),
    "sglang": (("model_name", "engine_type", "tp_rank", "pp_rank"), ("unified", "0", "0")),
    "sglang_tokenizer": (("model_name",), ()),
})
# Histograms: ours (GatewayMetrics attribute) -> the peers' (name, label set, bounds).
_HISTOGRAM_TWINS: Mapping[str, tuple[tuple[str, str, tuple[float, ...]], ...]] = MappingProxyType({
    "ttft": (("vllm:time_to_first_token_seconds", "vllm", _VLLM_TTFT),
             ("sglang:time_to_first_token_seconds", "sglang_tokenizer", _SGL_TTFT)),
    # A delta of n tokens counts n gaps of gap/n, as SGLang counts; vLLM counts one per engine step, the
    # same unless steps emit several tokens. time_per_output_token: vLLM's name for it until 0.11.
    "itl": (("vllm:inter_token_latency_seconds", "vllm", _VLLM_ITL),
            ("vllm:time_per_output_token_seconds", "vllm", _VLLM_ITL),
            ("sglang:inter_token_latency_seconds", "sglang_tokenizer", _SGL_ITL)),
    "e2e": (("vllm:e2e_request_latency_seconds", "vllm", _VLLM_REQUEST),
            ("sglang:e2e_request_latency_seconds", "sglang_tokenizer", _SGL_E2E)),
    "queue_time": (("vllm:request_queue_time_seconds", "vllm", _VLLM_REQUEST),
                   ("sglang:queue_time_seconds", "sglang", _SGL_QUEUE)),
})
# Counters the gateway counts: the peers' (name, label set) -> ours (finished requests: the count of
# shoal:e2e_request_latency_seconds).
_PROMPT, _GENERATED, _FINISHED = ("shoal:prompt_tokens_total", "shoal:generation_tokens_total",
                                  "shoal:e2e_request_latency_seconds_count")
_GATEWAY_COUNTER_TWINS: tuple[tuple[str, str, str], ...] = (
    ("vllm:prompt_tokens", "vllm", _PROMPT), ("vllm:generation_tokens", "vllm", _GENERATED),
    ("sglang:prompt_tokens", "sglang_tokenizer", _PROMPT),
    ("sglang:generation_tokens", "sglang_tokenizer", _GENERATED),
    ("sglang:num_requests", "sglang_tokenizer", _FINISHED),
)
# From the scheduler's stats: (name, counter?, label set, what of ours it is, its value). KV usage leaves out
# the evictable prefix cache, as vLLM's (free blocks include cached ones) and SGLang's (used = total - free
# - evictable) do. SGLang's cache hit rate and spec acceptance are of recent batches; ours, of the server's
# life (rate() of vllm:prefix_cache_hits / _queries gives a recent one).
_STATS_TWINS: tuple[tuple[str, bool, str, str, Callable[[SchedulerStats], float]], ...] = (
    ("vllm:num_requests_running", False, "vllm", "shoal:num_running_reqs", lambda s: s.num_running_reqs),
    ("vllm:num_requests_waiting", False, "vllm", "shoal:num_queue_reqs", lambda s: s.num_queue_reqs),
    ("vllm:kv_cache_usage_perc", False, "vllm", "shoal:kv_usage_ratio", lambda s: s.kv_usage_ratio),
    ("vllm:gpu_cache_usage_perc", False, "vllm", "shoal:kv_usage_ratio (kv_cache_usage_perc before vLLM 0.10)",
     lambda s: s.kv_usage_ratio),
    ("vllm:prefix_cache_queries", True, "vllm", "prompt tokens looked up in the prefix cache",
     lambda s: s.cache_query_tokens),
    ("vllm:prefix_cache_hits", True, "vllm", "prompt tokens found in the prefix cache", lambda s: s.cache_hit_tokens),
    ("vllm:num_preemptions", True, "vllm", "shoal:retractions", lambda s: s.retractions),
    ("vllm:spec_decode_num_drafts", True, "vllm", "request-steps verified with drafts", lambda s: s.spec_verify_reqs),
    ("vllm:spec_decode_num_draft_tokens", True, "vllm", "draft tokens proposed", lambda s: s.spec_draft_tokens),
    ("vllm:spec_decode_num_accepted_tokens", True, "vllm", "draft tokens accepted", lambda s: s.spec_accepted_tokens),
    ("sglang:num_running_reqs", False, "sglang", "shoal:num_running_reqs", lambda s: s.num_running_reqs),
    ("sglang:num_queue_reqs", False, "sglang", "shoal:num_queue_reqs", lambda s: s.num_queue_reqs),
    ("sglang:num_used_tokens", False, "sglang", "KV slots held by running requests", lambda s: s.num_used_tokens),
    ("sglang:token_usage", False, "sglang", "shoal:kv_usage_ratio", lambda s: s.kv_usage_ratio),
    ("sglang:max_total_num_tokens", False, "sglang", "KV pool size in tokens", lambda s: s.max_total_tokens),
    ("sglang:gen_throughput", False, "sglang", "tokens generated per second over the last log interval",
     lambda s: s.gen_throughput),
    ("sglang:cache_hit_rate", False, "sglang", "shoal:cache_hit_ratio",
     lambda s: s.cache_hit_tokens / max(s.cache_query_tokens, 1)),
    ("sglang:spec_accept_length", False, "sglang", "shoal:spec_accept_length", lambda s: s.spec_accept_length),
    ("sglang:spec_accept_rate", False, "sglang", "shoal:spec_accept_rate", lambda s: s.spec_accept_rate),
    ("sglang:num_retracted_requests", True, "sglang", "shoal:retractions", lambda s: s.retractions),
    ("sglang:cached_tokens", True, "sglang_tokenizer", "prompt tokens found in the prefix cache",
     lambda s: s.cache_hit_tokens),
)


def _system(name: str) -> str:
    return name.split(":", 1)[0]


def _under(name: str) -> str:
    return f"under {dict(vllm='vLLM', sglang='SGLang')[_system(name)]}'s name"


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
        yield from (batches, tokens, retractions, evictions, gc_seconds, gc_slow)
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


class _CompatCollector(Collector):
    """The peers' names for series of ours (the tables above), built from ours at each scrape."""

    def __init__(self, metrics: GatewayMetrics, systems: tuple[str, ...], model_name: Callable[[], str | None]):
        self.metrics, self.systems, self.model_name = metrics, systems, model_name

    def describe(self) -> Iterable[Metric]:
        return []  # families are built per scrape; nothing to pre-register

    def collect(self) -> Iterable[Metric]:
        model = self.model_name() or ""

        def labelled(family: type[Metric], name: str, doc: str, kind: str) -> tuple[Metric, list[str]]:
            names, values = _LABELS[kind]
            return family(name, doc, labels=names), [model, *values]

        m, on = self.metrics, self.systems
        counts = {_PROMPT: _value(m.prompt_tokens), _GENERATED: _value(m.generation_tokens)}
        for attr, twins in _HISTOGRAM_TWINS.items():
            ours, cumulative, total = _cumulative(getattr(m, attr))
            counts[f"{ours}_count"] = cumulative[float("inf")]
            for name, kind, bounds in twins:
                if _system(name) in on:
                    h, values = labelled(HistogramMetricFamily, name, f"{ours}, {_under(name)} and buckets", kind)
                    h.add_metric(values, [(floatToGoString(b), cumulative[b]) for b in (*bounds, float("inf"))],
                                 sum_value=total)
                    yield h
        for name, kind, ours in _GATEWAY_COUNTER_TWINS:
            if _system(name) in on:
                c, values = labelled(CounterMetricFamily, name, f"{ours}, {_under(name)}", kind)
                c.add_metric(values, counts[ours])
                yield c
        s = m._stats.stats
        if s is None:  # the engine is not ready: no scheduler numbers, as for ours
            return
        for name, is_counter, kind, what, value in _STATS_TWINS:
            if _system(name) in on:
                family = CounterMetricFamily if is_counter else GaugeMetricFamily
                f, values = labelled(family, name, f"{what}, {_under(name)}", kind)
                f.add_metric(values, float(value(s)))
                yield f


def _cumulative(hist: Histogram) -> tuple[str, dict[float, float], float]:
    """A histogram's name, its cumulative count at each of its bounds (+Inf included), and its sum."""
    family = hist.collect()[0]
    cumulative, total = {}, 0.0
    for sample in family.samples:
        if sample.name.endswith("_bucket"):
            cumulative[float(sample.labels["le"])] = sample.value
        elif sample.name.endswith("_sum"):
            total = sample.value
    return family.name, cumulative, total


def _value(counter: Counter) -> float:
    return next(s.value for s in counter.collect()[0].samples if s.name.endswith("_total"))


class GatewayMetrics:
    def __init__(self, compat: Iterable[str] = METRICS_COMPAT, model_name: Callable[[], str | None] = lambda: None):
        """compat: the peers (vllm, sglang) whose names are exposed too (ServerArgs.metrics_compat_names);
        model_name: the served model's name at scrape time, for their model_name label (None: unknown)."""
        systems = tuple(compat)
        unknown = sorted(set(systems) - set(METRICS_COMPAT))
        if unknown:
            raise ValueError(f"unknown metrics compat {unknown[0]!r}: expected some of {', '.join(METRICS_COMPAT)}")

        def buckets(attr: str, own: tuple[float, ...]) -> tuple[float, ...]:
            extra = (b for name, _, bounds in _HISTOGRAM_TWINS[attr] if _system(name) in systems for b in bounds)
            return tuple(sorted({*own, *extra}))

        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("shoal:time_to_first_token_seconds", "arrival at the gateway to first token",
                              buckets=buckets("ttft", _LATENCY_BUCKETS), registry=r)
        self.itl = Histogram("shoal:inter_token_latency_seconds", "time between consecutive output tokens",
                             buckets=buckets("itl", _ITL_BUCKETS), registry=r)
        self.e2e = Histogram("shoal:e2e_request_latency_seconds", "arrival at the gateway to the last token",
                             buckets=buckets("e2e", _LATENCY_BUCKETS), registry=r)
        self.queue_time = Histogram("shoal:queue_time_seconds", "time waiting in the scheduler queue",
                                    buckets=buckets("queue_time", _LATENCY_BUCKETS), registry=r)
        self.prompt_tokens = Counter("shoal:prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("shoal:generation_tokens", "tokens generated", registry=r)
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
            r.register(_CompatCollector(self, systems, model_name))

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

    def totals(self) -> tuple[float, float, float]:
        """(choices finished, prompt tokens of finished choices, tokens generated) since the app started."""
        # From the metrics themselves: the registry's get_sample_value would build every family, the
        # scheduler's and the compat ones included, for three numbers.
        return _cumulative(self.e2e)[1][float("inf")], _value(self.prompt_tokens), _value(self.generation_tokens)

    def refused(self, reason: str) -> None:
        self.rejected.inc()
        self.refusals.labels(reason).inc()

    def render(self, stats: SchedulerStats | None, estimate: WaitEstimate | None = None,
               routing: RoutingStats | None = None, replicas: list[SchedulerStats | None] | None = None) -> bytes:
        """Prometheus text exposition; stats None (engine not ready) leaves the scheduler families empty.
        replicas: each replica's (or DP rank's) own stats, for the per-replica families."""
        self._stats.stats, self._stats.replicas = stats, replicas or []
        self._admission.estimate, self._admission.routing = estimate, routing
        return generate_latest(self.registry)
