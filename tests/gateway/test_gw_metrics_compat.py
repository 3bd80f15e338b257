"""--metrics-compat: /metrics also exposes vLLM's and SGLang's names for the series Shoal measures alike,
with their types, labels and histogram buckets, read from ours at scrape time (so they always agree);
`none` leaves only ours. And the admission estimator's output share as shoal:admission_output_share."""

from __future__ import annotations

import argparse
import urllib.request

import pytest
from gw_helpers import GATEWAY_ARGS
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from runtime.config import ServerArgs
from runtime.errors import ServerArgsError
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.metrics_compat import counter_value
from runtime.gateway.state import STATE_KEY
from runtime.messages import SchedulerStats

# The peers' own bucket bounds, restated from vllm/v1/metrics/loggers.py and sglang/srt/metrics/collector.py.
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0]
SGL_TTFT = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
SGL_E2E = [*SGL_TTFT, 600, 1200, 1800, 2400]
SGL_ITL = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100, 0.200,
           0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000]
SGL_QUEUE = [0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500,
             600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000]
# peer histogram -> (ours, its bounds)
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("shoal:time_to_first_token_seconds", VLLM_TTFT),
    "vllm:inter_token_latency_seconds": ("shoal:inter_token_latency_seconds", VLLM_ITL),
    "vllm:time_per_output_token_seconds": ("shoal:inter_token_latency_seconds", VLLM_ITL),
    "vllm:e2e_request_latency_seconds": ("shoal:e2e_request_latency_seconds", VLLM_REQUEST),
    "vllm:request_queue_time_seconds": ("shoal:queue_time_seconds", VLLM_REQUEST),
    "sglang:time_to_first_token_seconds": ("shoal:time_to_first_token_seconds", SGL_TTFT),
    "sglang:inter_token_latency_seconds": ("shoal:inter_token_latency_seconds", SGL_ITL),
    "sglang:e2e_request_latency_seconds": ("shoal:e2e_request_latency_seconds", SGL_E2E),
    "sglang:queue_time_seconds": ("shoal:queue_time_seconds", SGL_QUEUE),
}
VLLM_LABELS = {"model_name", "engine"}
SGL_SCHEDULER_LABELS = {"model_name", "engine_type", "tp_rank", "pp_rank"}
SGL_TOKENIZER_LABELS = {"model_name"}
# peer gauge/counter -> (type, label names, ours in the same scrape or None)
SERIES = {
    "vllm:num_requests_running": ("gauge", VLLM_LABELS, "shoal:num_running_reqs"),
    "vllm:num_requests_waiting": ("gauge", VLLM_LABELS, "shoal:num_queue_reqs"),
    "vllm:kv_cache_usage_perc": ("gauge", VLLM_LABELS, "shoal:kv_usage_ratio"),
    "vllm:gpu_cache_usage_perc": ("gauge", VLLM_LABELS, "shoal:kv_usage_ratio"),
    "vllm:num_preemptions": ("counter", VLLM_LABELS, "shoal:retractions"),
    "vllm:prompt_tokens": ("counter", VLLM_LABELS, "shoal:prompt_tokens"),
    "vllm:generation_tokens": ("counter", VLLM_LABELS, "shoal:generation_tokens"),
    "vllm:prefix_cache_queries": ("counter", VLLM_LABELS, None),
    "vllm:prefix_cache_hits": ("counter", VLLM_LABELS, None),
    "vllm:spec_decode_num_drafts": ("counter", VLLM_LABELS, None),
    "vllm:spec_decode_num_draft_tokens": ("counter", VLLM_LABELS, None),
    "vllm:spec_decode_num_accepted_tokens": ("counter", VLLM_LABELS, None),
    "sglang:num_running_reqs": ("gauge", SGL_SCHEDULER_LABELS, "shoal:num_running_reqs"),
    "sglang:num_queue_reqs": ("gauge", SGL_SCHEDULER_LABELS, "shoal:num_queue_reqs"),
    "sglang:token_usage": ("gauge", SGL_SCHEDULER_LABELS, "shoal:kv_usage_ratio"),
    "sglang:cache_hit_rate": ("gauge", SGL_SCHEDULER_LABELS, "shoal:cache_hit_ratio"),
    "sglang:spec_accept_length": ("gauge", SGL_SCHEDULER_LABELS, "shoal:spec_accept_length"),
    "sglang:spec_accept_rate": ("gauge", SGL_SCHEDULER_LABELS, "shoal:spec_accept_rate"),
    "sglang:num_retracted_requests": ("counter", SGL_SCHEDULER_LABELS, "shoal:retractions"),
    "sglang:num_used_tokens": ("gauge", SGL_SCHEDULER_LABELS, None),
    "sglang:max_total_num_tokens": ("gauge", SGL_SCHEDULER_LABELS, None),
    "sglang:gen_throughput": ("gauge", SGL_SCHEDULER_LABELS, None),
    "sglang:prompt_tokens": ("counter", SGL_TOKENIZER_LABELS, "shoal:prompt_tokens"),
    "sglang:generation_tokens": ("counter", SGL_TOKENIZER_LABELS, "shoal:generation_tokens"),
    "sglang:cached_tokens": ("counter", SGL_TOKENIZER_LABELS, None),
    "sglang:num_requests": ("counter", SGL_TOKENIZER_LABELS, None),
}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def scrape(url: str) -> dict:
    return families(urllib.request.urlopen(url + "/metrics").read().decode())


def value(fams: dict, name: str, **labels: str) -> float:
    """The one sample of a family (a counter's _total), or the one with these labels."""
    [s] = [s for s in fams[name].samples if not s.name.endswith("_created")
           and all(s.labels.get(k) == v for k, v in labels.items())]
    return s.value


def buckets(fam) -> dict[float, float]:
    return {float(s.labels["le"]): s.value for s in fam.samples if s.name.endswith("_bucket")}


def hist_total(fam, suffix: str) -> float:
    [s] = [s for s in fam.samples if s.name.endswith(suffix)]
    return s.value


def check_histogram(fams: dict, name: str) -> None:
    ours_name, bounds = HISTOGRAMS[name]
    fam, ours = fams[name], fams[ours_name]
    assert fam.type == "histogram"
    labels = VLLM_LABELS if name.startswith("vllm:") else (
        SGL_SCHEDULER_LABELS if name == "sglang:queue_time_seconds" else SGL_TOKENIZER_LABELS)
    assert {k for s in fam.samples for k in s.labels if k != "le"} == labels, name
    theirs, mine = buckets(fam), buckets(ours)
    assert list(theirs) == [*map(float, bounds), float("inf")], name  # the peer's own buckets, in order
    assert all(theirs[b] == mine[b] for b in theirs), name
    assert hist_total(fam, "_count") == hist_total(ours, "_count")
    assert hist_total(fam, "_sum") == pytest.approx(hist_total(ours, "_sum"))


def test_compat_series_match_ours_on_a_live_server(gw_url, oai):
    before = scrape(gw_url)
    r = oai.completions.create(model="llama", prompt="The quick brown fox", max_tokens=6, temperature=0,
                               extra_body={"ignore_eos": True})
    chunks = list(oai.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert chunks
    fams = scrape(gw_url)

    for name in HISTOGRAMS:
        check_histogram(fams, name)
    for name, (kind, labels, ours) in SERIES.items():
        fam = fams[name]
        assert fam.type == kind, name
        [sample] = [s for s in fam.samples if not s.name.endswith("_created")]
        assert set(sample.labels) == labels, name
        assert sample.labels.get("engine", "0") == "0"
        assert (sample.labels.get("engine_type", "unified"), sample.labels.get("tp_rank", "0")) == ("unified", "0")
        if ours is not None:  # the same stats snapshot, the same gateway counters: equal, not close
            assert sample.value == value(fams, ours, **({"replica": "all"} if "spec_" in ours else {})), name
    # Those without a series of ours under the same meaning: what they are made of, from the same scrape.
    hits, queries = value(fams, "vllm:prefix_cache_hits"), value(fams, "vllm:prefix_cache_queries")
    assert 0 < queries and hits / queries == pytest.approx(value(fams, "shoal:cache_hit_ratio"))
    assert value(fams, "sglang:cached_tokens") == hits
    assert value(fams, "sglang:max_total_num_tokens") == 8192  # the gw_engine's pool
    assert value(fams, "sglang:num_used_tokens") / 8192 == pytest.approx(value(fams, "sglang:token_usage"))
    assert value(fams, "sglang:num_requests") == hist_total(fams["shoal:e2e_request_latency_seconds"], "_count")
    assert value(fams, "sglang:gen_throughput") >= 0

    # And they move with the requests.
    def delta(name: str) -> float:
        fam = fams[name]
        if fam.type == "histogram":
            return hist_total(fam, "_count") - hist_total(before[name], "_count")
        return value(fams, name) - value(before, name)

    assert delta("vllm:generation_tokens") == delta("sglang:generation_tokens") == 6 + 4
    assert delta("vllm:prompt_tokens") >= r.usage.prompt_tokens + 1
    assert delta("sglang:num_requests") == delta("vllm:e2e_request_latency_seconds") == 2
    assert delta("vllm:time_to_first_token_seconds") == delta("sglang:time_to_first_token_seconds") == 2
    assert delta("vllm:inter_token_latency_seconds") == (6 - 1) + (4 - 1)


def test_admission_output_share(gw_server, oai):
    oai.completions.create(model="llama", prompt="Once upon a time", max_tokens=8, temperature=0)
    fams = scrape(gw_server.url)
    share = value(fams, "shoal:admission_output_share")
    assert fams["shoal:admission_output_share"].type == "gauge"
    assert 0.05 <= share <= 1.0
    # The scrape observed the engine's stats last: the estimator's share as of then.
    assert share == pytest.approx(gw_server.app[STATE_KEY].admission.estimator.output.share)


def test_buckets_labels_and_values_exact():
    """Unit level, with known observations: each peer histogram counts what falls under its bounds, and
    every label carries the model's name."""
    m = GatewayMetrics(ServerArgs().metrics_compat_names, model_name=lambda: "tiny-model")
    observed = [0.0, 0.0005, 0.003, 0.0101, 0.02, 0.3, 0.35, 0.9, 1.0, 7.7, 150.0, 700.0, 5000.0]
    for v in observed:
        for h in (m.ttft, m.e2e, m.queue_time, m.itl):
            h.observe(v)
    stats = SchedulerStats(num_running_reqs=3, num_queue_reqs=7, num_used_tokens=250, num_cached_tokens=50,
                           max_total_tokens=1000, gen_throughput=123.5, retractions=2, cache_hit_tokens=30,
                           cache_query_tokens=120, spec_verify_reqs=10, spec_draft_tokens=40, spec_accepted_tokens=25)
    text = m.render(stats).decode()
    assert "_created" not in text  # prometheus_client's start-time series: noise, dropped (metrics.py)
    # ... from the gateway's output only: an embedding app's own metrics keep theirs (no process-wide switch)
    theirs = CollectorRegistry()
    Counter("app_jobs", "an embedding app's counter", registry=theirs).inc()
    assert "app_jobs_created" in generate_latest(theirs).decode()
    assert counter_value(m.prompt_tokens) == 0 and m.totals()[0] == 13  # our own readers skip _created
    fams = families(text)
    for name, (_, bounds) in HISTOGRAMS.items():
        check_histogram(fams, name)
        got = buckets(fams[name])
        assert got == {b: sum(v <= b for v in observed) for b in [*map(float, bounds), float("inf")]}, name
    expected = {"vllm:num_requests_running": 3, "vllm:num_requests_waiting": 7, "vllm:kv_cache_usage_perc": 0.25,
                "vllm:gpu_cache_usage_perc": 0.25, "vllm:num_preemptions": 2, "vllm:prefix_cache_queries": 120,
                "vllm:prefix_cache_hits": 30, "vllm:spec_decode_num_drafts": 10,
                "vllm:spec_decode_num_draft_tokens": 40, "vllm:spec_decode_num_accepted_tokens": 25,
                "sglang:num_running_reqs": 3, "sglang:num_queue_reqs": 7, "sglang:token_usage": 0.25,
                "sglang:num_used_tokens": 250, "sglang:max_total_num_tokens": 1000, "sglang:gen_throughput": 123.5,
                "sglang:cache_hit_rate": 0.25, "sglang:spec_accept_length": 3.5, "sglang:spec_accept_rate": 0.625,
                "sglang:num_retracted_requests": 2, "sglang:cached_tokens": 30}
    for name, want in expected.items():
        labels = {"model_name": "tiny-model"}
        labels |= {"engine": "0"} if name.startswith("vllm:") else (
            {} if name == "sglang:cached_tokens" else {"engine_type": "unified", "tp_rank": "0", "pp_rank": "0"})
        [sample] = fams[name].samples
        assert (sample.labels, sample.value) == (labels, pytest.approx(want)), name
    # The engine not ready yet: the gateway's histograms and counters only, as for ours.
    idle = families(GatewayMetrics(("vllm",)).render(None).decode())
    assert "vllm:time_to_first_token_seconds" in idle and "vllm:num_requests_waiting" not in idle


@pytest.mark.parametrize("flag, present", [("none", ()), ("vllm", ("vllm",)), ("sglang", ("sglang",)),
                                           (" SGLang , vllm ", ("vllm", "sglang"))])
def test_flag_chooses_the_peers(flag, present):
    args = ServerArgs(metrics_compat=flag)
    assert args.metrics_compat_names == present
    m = GatewayMetrics(args.metrics_compat_names)
    m.ttft.observe(0.5)
    names = set(families(m.render(SchedulerStats()).decode()))
    for peer in ("vllm", "sglang"):
        assert any(n.startswith(peer + ":") for n in names) == (peer in present), (flag, peer)
    if not present:  # ours keep their own buckets: nothing widened for peers that are not shown
        assert sorted(buckets(families(m.render(None).decode())["shoal:time_to_first_token_seconds"])) == [
            *VLLM_TTFT[:-2], float("inf")]


def test_flag_errors_and_cli():
    for bad in ("", "tgi", "none,vllm", "vllm,,sglang"):
        with pytest.raises(ServerArgsError, match="--metrics-compat"):
            ServerArgs(metrics_compat=bad)
    with pytest.raises(ServerArgsError, match="--metrics-compat"):
        ServerArgs.from_kwargs(metrics_compat=["vllm"])  # a YAML list is not the comma-separated string
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli(parser.parse_args([])).metrics_compat_names == ("vllm", "sglang")
    assert ServerArgs.from_cli(parser.parse_args(["--metrics-compat", "none"])).metrics_compat_names == ()
    assert GATEWAY_ARGS.metrics_compat == "vllm,sglang"


def test_live_flag_and_model_name_label(gw_engine, gw_url):
    """The gateway builds its metrics from ServerArgs: `none` serves only ours, and the peers' model_name
    label is the served model's name."""
    from runtime.gateway.server import serve_in_thread

    fams = scrape(gw_url)
    assert {s.labels["model_name"] for s in fams["vllm:num_requests_running"].samples} == {"llama"}
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(metrics_compat="none", served_model_name="mine"),
                         port=0) as handle:
        names = set(scrape(handle.url))
    assert names and not any(n.startswith(("vllm:", "sglang:")) for n in names)
    with serve_in_thread(gw_engine, GATEWAY_ARGS.replace(served_model_name="mine"), port=0) as handle:
        fams = scrape(handle.url)
    assert {s.labels["model_name"] for s in fams["sglang:num_running_reqs"].samples} == {"mine"}
