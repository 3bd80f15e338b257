"""/debug/ttft_trace: the gateway stamps each streamed single-choice request's first token on its way
(arrival, parsed, built, admitted, the engine's own FirstTokenTrace, delivered, first chunk written) and
reports the medians of the hops, which add up to the gateway's TTFT; a reset forgets them."""

from __future__ import annotations

import math

from gw_helpers import http, sse_events, wait_kv_full

from runtime.gateway.ttft_trace import HOPS


def test_first_token_hops_add_up_to_ttft(gw_url, gw_engine):
    status, _ = http(gw_url + "/debug/ttft_trace", "POST", {"reset": True})
    assert status == 200
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "stream": True,
            "ignore_eos": True}
    status, raw = http(gw_url + "/v1/completions", "POST", body)
    assert status == 200 and sse_events(raw)[-1] == "[DONE]"
    one = http(gw_url + "/debug/ttft_trace")[1]
    assert one["requests"] == 1 and math.isclose(sum(one[f"{h}_ms"] for h in HOPS), one["ttft_ms"], rel_tol=1e-6)
    for _ in range(2):
        status, raw = http(gw_url + "/v1/completions", "POST", body)
        assert status == 200 and sse_events(raw)[-1] == "[DONE]"
    http(gw_url + "/v1/completions", "POST", {**body, "n": 2})  # two choices: not traced
    http(gw_url + "/v1/completions", "POST", {**body, "stream": False})  # not streamed: no first chunk
    status, trace = http(gw_url + "/debug/ttft_trace")
    assert status == 200 and trace["requests"] == 3, trace
    hops = [trace[f"{h}_ms"] for h in HOPS]
    assert all(h >= 0 for h in hops), trace
    assert trace["prefill_ms"] > 0 and trace["ttft_ms"] > trace["prefill_ms"]
    # Medians of the parts need not add up to the median of the whole exactly; with 3 similar requests
    # on an idle engine they come close.
    assert math.isclose(sum(hops), trace["ttft_ms"], rel_tol=0.5), trace
    http(gw_url + "/debug/ttft_trace", "POST", {"reset": True})
    assert http(gw_url + "/debug/ttft_trace")[1] == {"requests": 0}
    wait_kv_full(gw_engine)
