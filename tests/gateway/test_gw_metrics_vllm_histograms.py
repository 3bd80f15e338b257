"""vLLM's series of finished requests on /metrics (its Grafana dashboard's length heatmaps and finish reason
panel): vllm:request_prompt_tokens, _generation_tokens, _params_max_tokens, _max_num_generation_tokens,
_params_n and vllm:request_success by finished_reason, with vLLM's labels and buckets
(build_1_2_5_buckets(max_model_len); n's own), read from shoal:* series of the same values; pooling
requests (embeddings, /encode) among them, as vLLM counts them."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from gw_helpers import GATEWAY_ARGS, http
from prometheus_client.parser import text_string_to_metric_families

from runtime import Engine
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.server import serve_in_thread

INF = float("inf")
TOKEN_TWINS = {  # vLLM's -> ours
    "vllm:request_prompt_tokens": "shoal:request_prompt_tokens",
    "vllm:request_generation_tokens": "shoal:request_generation_tokens",
    "vllm:request_params_max_tokens": "shoal:request_params_max_tokens",
    "vllm:request_max_num_generation_tokens": "shoal:request_max_num_generation_tokens",
}
N_BOUNDS = [1.0, 2.0, 5.0, 10.0, 20.0]


def bounds_1_2_5(max_value: int) -> list[float]:
    """vLLM's build_1_2_5_buckets, restated."""
    return [float(m * 10 ** e) for e in range(12) for m in (1, 2, 5) if m * 10 ** e <= max_value]


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def scrape(url: str) -> dict:
    return families(urllib.request.urlopen(url + "/metrics").read().decode())


def hist(fam) -> tuple[dict[float, float], float, float]:
    """(cumulative count per bound, count, sum) of a histogram family's one series."""
    buckets = {float(s.labels["le"]): s.value for s in fam.samples if s.name.endswith("_bucket")}
    [count] = [s.value for s in fam.samples if s.name.endswith("_count")]
    [total] = [s.value for s in fam.samples if s.name.endswith("_sum")]
    return buckets, count, total


def expected(values: list[float], bounds: list[float]) -> dict[float, float]:
    return {b: sum(v <= b for v in values) for b in [*bounds, INF]}


def reasons(fams: dict, name: str = "vllm:request_success") -> dict[str, float]:
    key = "finished_reason" if name.startswith("vllm:") else "reason"
    return {s.labels[key]: s.value for s in fams[name].samples if s.name.endswith("_total")}


def check_twins(fams: dict, bounds: list[float], model: str) -> None:
    """vLLM's histograms: its labels and bounds, ours read at them."""
    for name, ours in [*TOKEN_TWINS.items(), ("vllm:request_params_n", "shoal:request_params_n")]:
        fam = fams[name]
        assert fam.type == "histogram"
        assert {(k, v) for s in fam.samples for k, v in s.labels.items() if k != "le"} == {
            ("model_name", model), ("engine", "0")}, name
        theirs, count, total = hist(fam)
        mine, my_count, my_total = hist(fams[ours])
        assert list(theirs) == ([*N_BOUNDS, INF] if name.endswith("_n") else [*bounds, INF]), name
        assert all(theirs[b] == mine[b] for b in theirs) and (count, total) == (my_count, my_total), name
    [labels] = {tuple(sorted(s.labels)) for s in fams["vllm:request_success"].samples}
    assert labels == ("engine", "finished_reason", "model_name")
    assert reasons(fams) == reasons(fams, "shoal:requests_finished")


def test_values_buckets_and_labels_exact():
    m = GatewayMetrics(("vllm", "sglang"), model_name=lambda: "tiny", max_model_len=lambda: 1000)
    # (prompt, generated, max_tokens, reason) of each finished choice
    done = [(3, 5, 5, "length"), (700, 1, 5000, "stop"), (40, 0, None, "abort"), (1000, 20, 0, "error"),
            (12, 12, 12, "length")]
    for prompt, generated, max_tokens, reason in done:
        m.finished(prompt, generated, max_tokens, reason)
    m.finished_prompt(1, 5)
    m.finished_prompt(3, 20)
    m.finished_prompt(20, 12)
    fams = families(m.render(None).decode())  # the engine's stats are not needed for these
    bounds = bounds_1_2_5(1000)
    assert bounds == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    check_twins(fams, bounds, "tiny")
    want = {
        "vllm:request_prompt_tokens": [3, 700, 40, 1000, 12],
        "vllm:request_generation_tokens": [5, 1, 0, 20, 12],
        # 5000 asked with a 700-token prompt: 300 could come (vLLM's get_max_tokens); none and 0: not counted
        "vllm:request_params_max_tokens": [5, 300, 12],
        "vllm:request_max_num_generation_tokens": [5, 20, 12],
    }
    for name, values in want.items():
        assert hist(fams[name]) == (expected(values, bounds), len(values), sum(values)), name
    assert hist(fams["vllm:request_params_n"]) == (expected([1, 3, 20], N_BOUNDS), 3, 24)
    assert reasons(fams) == {"stop": 1, "length": 2, "abort": 1, "error": 1}
    [prompt_total] = [s.value for s in fams["shoal:prompt_tokens"].samples if s.name.endswith("_total")]
    assert prompt_total == 3 + 700 + 40 + 1000 + 12


def test_unknown_context_and_compat_off():
    """Before the context length is known vLLM's token histograms wait (their bounds depend on it); n and
    the finish reasons, every one at 0, are there. Without vLLM's names, ours alone."""
    fams = families(GatewayMetrics(("vllm",)).render(None).decode())
    assert not any(name in fams for name in TOKEN_TWINS)
    assert hist(fams["vllm:request_params_n"]) == (expected([], N_BOUNDS), 0, 0)
    assert reasons(fams) == {"stop": 0, "length": 0, "abort": 0, "error": 0}
    big = families(GatewayMetrics(("vllm",), max_model_len=lambda: 131072).render(None).decode())
    assert list(hist(big["vllm:request_prompt_tokens"])[0]) == [*bounds_1_2_5(131072), INF]
    assert bounds_1_2_5(131072)[-1] == 100000
    ours = families(GatewayMetrics((), max_model_len=lambda: 1000).render(None).decode())
    assert not any(n.startswith("vllm:") for n in ours)
    assert {*TOKEN_TWINS.values(), "shoal:request_params_n", "shoal:requests_finished"} <= set(ours)


def test_live_requests(gw_engine, gw_url, oai):
    """Through the gateway: two prompts with n=2 (four engine requests, two parents) ending by length, one
    stopped by a stop token; vLLM's buckets are of the engine's context length."""
    before = scrape(gw_url)
    r = oai.completions.create(model="llama", prompt=[[1, 2, 3], [5, 6, 7, 8, 9]], n=2, max_tokens=5,
                               temperature=0, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in r.choices] == ["length"] * 4 and r.usage.completion_tokens == 20
    first = gw_engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1, "temperature": 0})
    s = oai.completions.create(model="llama", prompt=[1, 2, 3], max_tokens=7, temperature=0,
                               extra_body={"stop_token_ids": first["output_ids"]})
    assert s.choices[0].finish_reason == "stop"
    stopped = s.usage.completion_tokens
    after = scrape(gw_url)

    bounds = bounds_1_2_5(gw_engine.context_len)
    check_twins(after, bounds, "llama")

    def delta(name: str) -> tuple[dict[float, float], float, float]:
        (b1, c1, s1), (b0, c0, s0) = hist(after[name]), hist(before[name])
        return {b: b1[b] - b0[b] for b in b1}, c1 - c0, s1 - s0

    want = {
        "vllm:request_prompt_tokens": [3, 3, 5, 5, 3],
        "vllm:request_generation_tokens": [5, 5, 5, 5, stopped],
        "vllm:request_params_max_tokens": [5, 5, 5, 5, 7],
        "vllm:request_max_num_generation_tokens": [5, 5, stopped],
    }
    for name, values in want.items():
        assert delta(name) == (expected(values, bounds), len(values), pytest.approx(sum(values))), name
    assert delta("vllm:request_params_n") == (expected([2, 2, 1], N_BOUNDS), 3, 5)
    grew = {k: v - reasons(before).get(k, 0) for k, v in reasons(after).items()}
    assert grew == {"stop": 1, "length": 4, "abort": 0, "error": 0}


@pytest.fixture()
def emb_server(tiny_model_dirs) -> Iterator[tuple[Engine, str]]:
    engine = Engine(str(tiny_model_dirs["qwen3"]), device="cpu", is_embedding=True, log_level="warning")
    try:
        with serve_in_thread(engine, GATEWAY_ARGS, port=0) as server:
            yield engine, server.url
    finally:
        engine.shutdown()


def test_pooling_requests_counted(emb_server):
    """vLLM counts a pooling request among its finished requests: finish reason stop, n=1, nothing generated,
    no max_tokens; its prompt tokens once in vllm:prompt_tokens (not again beside the finished count)."""
    engine, url = emb_server
    before = scrape(url)
    status, emb = http(url + "/v1/embeddings", "POST", {"input": ["hello world", "a b c d"]})
    assert status == 200, emb
    status, enc = http(url + "/encode", "POST", {"text": "one more input"})
    assert status == 200, enc
    after = scrape(url)
    prompts = emb["usage"]["prompt_tokens"] + enc["meta_info"]["prompt_tokens"]
    check_twins(after, bounds_1_2_5(engine.context_len), http(url + "/v1/models")[1]["data"][0]["id"])

    def grew(name: str) -> tuple[float, float]:
        (_, c1, s1), (_, c0, s0) = hist(after[name]), hist(before[name])
        return c1 - c0, s1 - s0

    assert grew("vllm:request_prompt_tokens") == (3, prompts)
    assert grew("vllm:request_generation_tokens") == (3, 0)
    assert grew("vllm:request_max_num_generation_tokens") == (3, 0)
    assert grew("vllm:request_params_n") == (3, 3)
    assert grew("vllm:request_params_max_tokens") == (0, 0)
    assert {k: v - reasons(before)[k] for k, v in reasons(after).items()} == {
        "stop": 3, "length": 0, "abort": 0, "error": 0}

    def total(fams: dict, name: str) -> float:
        return next(s.value for s in fams[name].samples if s.name.endswith("_total"))

    assert total(after, "vllm:prompt_tokens") - total(before, "vllm:prompt_tokens") == prompts
