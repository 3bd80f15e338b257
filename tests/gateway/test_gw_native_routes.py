"""The non-OpenAI routes (/generate, /health, /health_generate, /abort_request, /metrics, /v1/models),
the API key, and 503 while the engine is not there."""

from __future__ import annotations

import threading
import time
import urllib.request

import openai
import pytest
from gw_helpers import GATEWAY_ARGS, http, sse_events
from prometheus_client.parser import text_string_to_metric_families

from runtime.gateway.server import serve_in_thread


def test_models(gw_url):
    status, body = http(gw_url + "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert body["data"][0]["id"] == "llama" and body["data"][0]["max_model_len"] == 512


def test_generate_text_ids_batch(gw_url, gw_engine):
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    status, a = http(gw_url + "/generate", "POST", {"text": "Hello world", "sampling_params": sp})
    assert status == 200 and len(a["output_ids"]) == 5
    assert a["text"] == gw_engine.tokenizer.decode(a["output_ids"])
    meta = a["meta_info"]
    assert meta["prompt_tokens"] == len(gw_engine.tokenizer.encode("Hello world"))
    assert meta["completion_tokens"] == 5 and meta["finish_reason"]["type"] == "length"
    assert 0 <= meta["cached_tokens"] <= meta["prompt_tokens"]
    ids = gw_engine.tokenizer.encode("Hello world")
    status, b = http(gw_url + "/generate", "POST", {"input_ids": ids, "sampling_params": sp})
    assert b["output_ids"] == a["output_ids"]
    status, batch = http(gw_url + "/generate", "POST", {"input_ids": [ids, ids[:3]], "sampling_params": sp})
    assert status == 200 and len(batch) == 2 and batch[0]["output_ids"] == a["output_ids"]


def test_generate_logprobs(gw_url):
    status, r = http(gw_url + "/generate", "POST", {"text": "Hi", "return_logprob": True, "top_logprobs_num": 2,
                                                    "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    meta = r["meta_info"]
    assert [t for _, t in meta["output_token_logprobs"]] == r["output_ids"]
    assert all(len(step) == 2 for step in meta["output_top_logprobs"])


def test_generate_stream_is_cumulative(gw_url):
    status, raw = http(gw_url + "/generate", "POST", {"text": "Hello", "stream": True, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    objs = events[:-1]
    assert all(o["meta_info"]["finish_reason"] is None for o in objs[:-1])
    assert objs[-1]["meta_info"]["finish_reason"]["type"] == "length" and len(objs[-1]["output_ids"]) == 6
    for prev, cur in zip(objs, objs[1:]):
        assert cur["text"].startswith(prev["text"]) and cur["output_ids"][:len(prev["output_ids"])] == prev["output_ids"]


def test_abort_request_by_rid(gw_url, gw_engine):
    result = {}

    def run():
        result["r"] = http(gw_url + "/generate", "POST", {"text": "Hi", "rid": "abort-me", "sampling_params": {
            "max_new_tokens": 480, "ignore_eos": True}})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10
    while "abort-me" not in gw_engine.scheduler.reqs and time.monotonic() < deadline:
        time.sleep(0.01)
    status, err = http(gw_url + "/generate", "POST", {"text": "Hi", "rid": "abort-me"})
    assert status == 400 and err["error"]["param"] == "rid" and "already in use" in err["error"]["message"]
    assert http(gw_url + "/abort_request", "POST", {"rid": "abort-me"}) == (200, {"aborted": ["abort-me"]})
    t.join(timeout=20)
    status, body = result["r"]
    assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort"
    assert body["meta_info"]["completion_tokens"] < 480


def test_health_and_health_generate(gw_url):
    assert http(gw_url + "/health") == (200, {"status": "ok"})
    assert http(gw_url + "/health_generate") == (200, {"status": "ok"})


def test_version(gw_url):
    import importlib.metadata

    assert http(gw_url + "/version") == (200, {"version": importlib.metadata.version("shoal")})


def _metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics_move(gw_url, oai):
    before = _metrics(gw_url)
    for name in ("shoal:num_running_reqs", "shoal:num_queue_reqs", "shoal:kv_usage_ratio", "shoal:kv_cache_ratio",
                 "shoal:cache_hit_ratio", "shoal:retractions_total", "shoal:cache_evictions_total",
                 "shoal:forward_batches_total{mode=extend}", "shoal:forward_tokens_total{mode=decode}",
                 "shoal:prompt_tokens_total", "shoal:generation_tokens_total",
                 "shoal:time_to_first_token_seconds_count", "shoal:inter_token_latency_seconds_count",
                 "shoal:e2e_request_latency_seconds_count", "shoal:queue_time_seconds_count",
                 "shoal:scheduler_gc_pause_seconds_total", "shoal:scheduler_gc_slow_pauses_total"):
        assert name in before, name
    r = oai.completions.create(model="llama", prompt="The quick brown fox jumps", max_tokens=7, temperature=0,
                               extra_body={"ignore_eos": True})
    after = _metrics(gw_url)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("shoal:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("shoal:generation_tokens_total") == 7
    assert delta("shoal:time_to_first_token_seconds_count") == 1
    assert delta("shoal:e2e_request_latency_seconds_count") == 1
    assert delta("shoal:queue_time_seconds_count") == 1
    assert delta("shoal:inter_token_latency_seconds_count") == 6
    assert delta("shoal:forward_batches_total{mode=extend}") >= 1
    assert delta("shoal:forward_tokens_total{mode=decode}") >= 6
    assert 0 <= after["shoal:kv_usage_ratio"] <= 1 and 0 <= after["shoal:cache_hit_ratio"] <= 1
    # The scheduler's collections are timed (runtime/gc_guard.py): serving makes some, however short.
    assert after["shoal:scheduler_gc_pause_seconds_total"] > 0
    assert delta("shoal:scheduler_gc_slow_pauses_total") >= 0


def test_api_key(gw_engine):
    args = GATEWAY_ARGS.replace(api_key="sk-test")
    with serve_in_thread(gw_engine, args, port=0) as server:
        for path, method, body in (("/v1/models", "GET", None), ("/v1/completions", "POST", {"prompt": "hi"}),
                                   ("/generate", "POST", {"text": "hi"})):
            status, err = http(server.url + path, method, body)
            assert status == 401 and err["error"]["code"] == "invalid_api_key", path
            status, _ = http(server.url + path, method, body, headers={"Authorization": "Bearer wrong"})
            assert status == 401
        assert http(server.url + "/health")[0] == 200
        assert http(server.url + "/health_generate")[0] == 200  # every /health* path is a probe's, as SGLang's
        assert http(server.url + "/metrics")[0] == 200
        # An Authorization header whose bytes are not UTF-8 is a wrong key, not a server error.
        import socket

        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                         b"Connection: close\r\n\r\n")
            assert sock.recv(64).startswith(b"HTTP/1.1 401")
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
        r = good.completions.create(model="llama", prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens >= 1


def test_503_until_ready(gw_engine):
    holder: dict = {"client": None}
    with serve_in_thread(lambda: holder["client"], GATEWAY_ARGS, port=0) as server:
        for path, method, body in (("/health", "GET", None), ("/v1/models", "GET", None),
                                   ("/v1/completions", "POST", {"prompt": "hi"}),
                                   ("/v1/chat/completions", "POST", {"messages": [{"role": "user", "content": "x"}]}),
                                   ("/generate", "POST", {"text": "hi"}), ("/health_generate", "GET", None)):
            status, err = http(server.url + path, method, body)
            assert status == 503 and "starting" in err["error"]["message"], path
        status, text = http(server.url + "/metrics")
        assert status == 200 and "shoal:prompt_tokens_total" in text
        holder["client"] = gw_engine  # loaded: the same app now serves
        assert http(server.url + "/health")[0] == 200
        status, body = http(server.url + "/v1/completions", "POST", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
