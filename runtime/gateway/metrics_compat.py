"""CompatCollector: the series of vLLM's and SGLang's /metrics that one of ours already measures, under their
names, types and labels (--metrics-compat), so dashboards, alerts and autoscalers (KEDA/HPA, the Gateway API
Inference Extension's endpoint picker) written for them keep working. Built from ours at each scrape, never
observed twice on the token path; our histograms carry the union of the bucket bounds, so each of theirs is
ours read at its own bounds, exactly.

vLLM's histograms of counts (its Grafana dashboard's prompt and generation length heatmaps) take
build_1_2_5_buckets(max_model_len) as bounds: 1, 2, 5, 10, ... up to the context length. Ours hold that
series far past any context, so theirs is a prefix of ours; they appear once the context length is known
(the engine is ready), as the scheduler's series do.

vllm:iteration_tokens_total is shoal:iteration_tokens: the scheduler counts each step's tokens at vLLM's
bounds (ITERATION_TOKEN_BOUNDS), summed over replicas and DP ranks. Ours are the tokens a step runs (a prompt
chunk's uncached tokens, one per decode, a verify step's drafts); vLLM adds up what a step finished: the
whole prompt (its cached part too) in the step that ends its prefill, and the tokens emitted.

vllm:lora_requests_info (--enable-lora only, as vLLM's): one gauge series whose labels carry the adapters
(SchedulerStats.lora: max_lora = --max-loras, waiting_lora_adapters and running_lora_adapters the
comma-joined names, "" for none; over replicas and DP ranks, any one's names and their max_lora summed)
and whose value is the time they were read (Unix seconds). vLLM sets the series of the current labels to
the time at each engine step and keeps every label set it ever showed at its last time, so its readers (the
endpoint picker) take the series with the latest value; ours is only that one. Where vLLM's lists are by
first arrival, ours are sorted, so an unchanged set keeps its series; vLLM's recent releases name every
adapter with a request in both lists, ours as before them (and as the label names say): running the
adapters of requests running, waiting those of requests queued."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from runtime.messages import ITERATION_TOKEN_BOUNDS, LoraRequests, SchedulerStats

if TYPE_CHECKING:
    from runtime.gateway.metrics import GatewayMetrics

# The peers' own bounds (vllm/v1/metrics/loggers.py PrometheusStatLogger; sglang/srt/metrics/collector.py
# TokenizerMetricsCollector and SchedulerMetricsCollector defaults).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0)
_VLLM_TTFT = (*LATENCY_BUCKETS, 640.0, 2560.0)
_VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0)
_VLLM_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
VLLM_N = (1.0, 2.0, 5.0, 10.0, 20.0)
_SGL_TTFT = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0)
_SGL_E2E = (*_SGL_TTFT, 600.0, 1200.0, 1800.0, 2400.0)
_SGL_ITL = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4,
            0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)
_SGL_QUEUE = (0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0,
              90.0, 100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0, 900.0, 1000.0, 1200.0, 1400.0,
              1600.0, 1800.0, 2000.0, 2500.0, 3000.0)


def build_1_2_5_buckets(max_value: float) -> tuple[float, ...]:
    """vLLM's bounds for counts: 1, 2, 5, 10, 20, 50, ... while <= max_value."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


# Ours for token counts: far past any context length, so vLLM's (a prefix of the same series) are among them.
TOKEN_BUCKETS = build_1_2_5_buckets(10 ** 8)

# Each peer's label names and, for a whole server (its replicas and DP ranks summed, as ours are), their
# values: vLLM's PrometheusStatLogger (engine: the EngineCore index); SGLang's scheduler collector (one
# TP/PP rank 0 of a "unified" engine) and its tokenizer collector. Label values come after the model name.
_LABELS: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = MappingProxyType({
    "vllm": (("model_name", "engine"), ("0",)),
    "sglang": (("model_name", "engine_type", "tp_rank", "pp_rank"), ("unified", "0", "0")),
    "sglang_tokenizer": (("model_name",), ()),
})
# Histograms: ours (GatewayMetrics attribute) -> the peers' (name, label set, bounds).
HISTOGRAM_TWINS: Mapping[str, tuple[tuple[str, str, tuple[float, ...]], ...]] = MappingProxyType({
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
# vLLM's histograms of finished requests' counts: ours (GatewayMetrics attribute) -> vLLM's name and bounds
# (None: build_1_2_5_buckets(max_model_len)). An n > 1 request is n engine requests to vLLM (each counted in
# the first three) under one parent (counted once in the last two, when its last choice ends).
_COUNT_TWINS: tuple[tuple[str, str, tuple[float, ...] | None], ...] = (
    ("request_prompt_tokens", "vllm:request_prompt_tokens", None),
    ("request_generation_tokens", "vllm:request_generation_tokens", None),
    ("request_max_tokens", "vllm:request_params_max_tokens", None),
    ("request_max_generation_tokens", "vllm:request_max_num_generation_tokens", None),
    ("request_n", "vllm:request_params_n", VLLM_N),
)
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


def system_of(name: str) -> str:
    return name.split(":", 1)[0]


def _under(name: str) -> str:
    return f"under {dict(vllm='vLLM', sglang='SGLang')[system_of(name)]}'s name"


class CompatCollector(Collector):
    """The peers' names for series of ours (the tables above), built from ours at each scrape."""

    def __init__(self, metrics: GatewayMetrics, systems: tuple[str, ...], model_name: Callable[[], str | None]):
        self.metrics, self.systems, self.model_name = metrics, systems, model_name

    def describe(self) -> Iterable[Metric]:
        return []  # families are built per scrape; nothing to pre-register

    def collect(self) -> Iterable[Metric]:
        model = self.model_name() or ""

        def labelled(family: type[Metric], name: str, doc: str, kind: str,
                     extra: tuple[str, ...] = ()) -> tuple[Metric, list[str]]:
            names, values = _LABELS[kind]
            return family(name, doc, labels=[*names, *extra]), [model, *values]

        def histogram(name: str, ours: Histogram, kind: str, bounds: tuple[float, ...]) -> Metric:
            own, cumulative, total = cumulative_counts(ours)
            h, values = labelled(HistogramMetricFamily, name, f"{own}, {_under(name)} and buckets", kind)
            h.add_metric(values, [(floatToGoString(b), cumulative[b]) for b in (*bounds, float("inf"))],
                         sum_value=total)
            return h

        m, on = self.metrics, self.systems
        counts = {_PROMPT: counter_value(m.prompt_tokens), _GENERATED: counter_value(m.generation_tokens),
                  _FINISHED: cumulative_counts(m.e2e)[1][float("inf")]}
        for attr, twins in HISTOGRAM_TWINS.items():
            for name, kind, bounds in twins:
                if system_of(name) in on:
                    yield histogram(name, getattr(m, attr), kind, bounds)
        for name, kind, ours in _GATEWAY_COUNTER_TWINS:
            if system_of(name) in on:
                c, values = labelled(CounterMetricFamily, name, f"{ours}, {_under(name)}", kind)
                c.add_metric(values, counts[ours])
                yield c
        if "vllm" in on:
            yield from self._vllm_requests(histogram, labelled)
        s = m.scheduler_stats
        if s is None:  # the engine is not ready: no scheduler numbers, as for ours
            return
        for name, is_counter, kind, what, value in _STATS_TWINS:
            if system_of(name) in on:
                family = CounterMetricFamily if is_counter else GaugeMetricFamily
                f, values = labelled(family, name, f"{what}, {_under(name)}", kind)
                f.add_metric(values, float(value(s)))
                yield f
        if "vllm" in on:
            name = "vllm:iteration_tokens_total"
            h, values = labelled(HistogramMetricFamily, name, f"shoal:iteration_tokens, {_under(name)}", "vllm")
            h.add_metric(values, iteration_buckets(s), sum_value=s.iteration_tokens_sum)
            yield h
            if s.lora is not None:
                yield lora_info(s.lora)

    def _vllm_requests(self, histogram: Callable[..., Metric], labelled: Callable[..., tuple[Metric, list[str]]]
                       ) -> Iterable[Metric]:
        """vLLM's series of finished requests: their counts by finish reason, and the histograms of counts."""
        m = self.metrics
        name = "vllm:request_success"
        c, values = labelled(CounterMetricFamily, name, f"shoal:requests_finished by reason, {_under(name)}",
                             "vllm", ("finished_reason",))
        for reason, n in labelled_counts(m.requests_finished).items():
            c.add_metric([*values, reason], n)
        yield c
        max_model_len = m.max_model_len()
        for attr, name, bounds in _COUNT_TWINS:
            if bounds is None:
                if max_model_len is None:  # the bounds are not known yet; no request has finished either
                    continue
                bounds = build_1_2_5_buckets(max_model_len)
            yield histogram(name, getattr(m, attr), "vllm", bounds)


def lora_info(lora: LoraRequests) -> Metric:
    """vllm:lora_requests_info: the adapters in its labels, the time they were read as its value."""
    g = GaugeMetricFamily("vllm:lora_requests_info", "adapters of the requests running and waiting (labels), "
                          "as of the time in seconds since the epoch (value), under vLLM's name",
                          labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    g.add_metric([str(lora.max_loras), ",".join(lora.waiting), ",".join(lora.running)], time.time())
    return g


def iteration_buckets(s: SchedulerStats) -> list[tuple[str, float]]:
    """The scheduler's steps by tokens as Prometheus buckets: (le, cumulative count), +Inf last.

    Read at len(ITERATION_TOKEN_BOUNDS) + 1 counts whatever length the replicas sent: short lists are padded
    with 0, extras (bounds this gateway does not know) are folded into +Inf, so +Inf is always there and equals
    the count of steps."""
    size = len(ITERATION_TOKEN_BOUNDS) + 1
    counts = [*s.iteration_tokens[:size], *[0] * (size - len(s.iteration_tokens))]
    counts[-1] += sum(s.iteration_tokens[size:])
    out, running = [], 0
    for bound, n in zip((*ITERATION_TOKEN_BOUNDS, float("inf")), counts):
        running += n
        out.append((floatToGoString(bound), float(running)))
    return out


def cumulative_counts(hist: Histogram) -> tuple[str, dict[float, float], float]:
    """A histogram's name, its cumulative count at each of its bounds (+Inf included), and its sum."""
    family = hist.collect()[0]
    cumulative, total = {}, 0.0
    for sample in family.samples:
        if sample.name.endswith("_bucket"):
            cumulative[float(sample.labels["le"])] = sample.value
        elif sample.name.endswith("_sum"):
            total = sample.value
    return family.name, cumulative, total


def counter_value(counter: Counter) -> float:
    return next(s.value for s in counter.collect()[0].samples if s.name.endswith("_total"))


def labelled_counts(counter: Counter) -> dict[str, float]:
    """A counter with one label: each label value's count."""
    return {next(iter(s.labels.values())): s.value for s in counter.collect()[0].samples
            if s.name.endswith("_total")}
