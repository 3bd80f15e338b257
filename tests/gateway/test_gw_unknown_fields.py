"""Fields Shoal does not know (issue 19, item 1): the official openai client sends newer OpenAI fields;
they are accepted and ignored at any depth, logged once per name and counted in /metrics. A known field
whose value Shoal cannot honour is still a 400 that says so."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import openai
import pytest
from gw_helpers import GATEWAY_ARGS, http
from log_lines import LogLines
from prometheus_client.parser import text_string_to_metric_families

from runtime.gateway.server import serve_in_thread

MODEL = "llama"
MESSAGES = [{"role": "user", "content": "Hello world!"}]
_LABELS = ("store", "metadata", "service_tier", "reasoning_effort", "prompt_cache_key", "safety_identifier",
           "verbosity", "stream_options.include_obfuscation", "messages[].colour")


def _ignored_counts(url: str) -> dict[str, float]:
    _, text = http(url + "/metrics")
    return {s.labels["field"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "shoal:ignored_request_fields_total"}


@pytest.fixture()
def gateway_log():
    handler = LogLines(logging.INFO)
    log = logging.getLogger("shoal.gateway")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler.messages
    log.removeHandler(handler)
    log.setLevel(level)


@pytest.fixture()
def own_url(gw_engine) -> Iterator[str]:
    """A gateway of its own: no other test's made-up keys filled its 64 labels."""
    with serve_in_thread(gw_engine, GATEWAY_ARGS, port=0) as server:
        yield server.url


def test_official_client_fields_are_accepted_logged_once_and_counted(own_url, gateway_log):
    gw_url = own_url
    oai = openai.OpenAI(base_url=gw_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    before = _ignored_counts(gw_url)
    kw = dict(model=MODEL, max_tokens=3, temperature=0, store=True, metadata={"team": "a"},
              service_tier="auto", reasoning_effort="low", prompt_cache_key="k1", safety_identifier="user-1",
              verbosity="low", extra_body={"ignore_eos": True})
    messages = [{"role": "user", "content": "Hello world!", "colour": "blue"}]
    plain = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True})
    for _ in range(2):
        r = oai.chat.completions.create(messages=messages, **kw)
        assert r.choices[0].message.content == plain.choices[0].message.content  # ignored: same answer
        chunks = list(oai.chat.completions.create(messages=messages, stream=True,
                                                  stream_options={"include_usage": True, "include_obfuscation": True},
                                                  **kw))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 3  # known keys beside the unknown one still count
    after = _ignored_counts(gw_url)
    for name in _LABELS:
        grew = after.get(name, 0) - before.get(name, 0)
        assert grew == (2 if name == "stream_options.include_obfuscation" else 4), name
        assert sum(f"'{name}'" in m for m in gateway_log) == 1, name  # logged once per name
    r = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"future_knob": 1})
    assert r.usage.completion_tokens == 2
    assert _ignored_counts(gw_url)["future_knob"] == before.get("future_knob", 0) + 1


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "frobnicate": {"deep": [1, 2]}}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "frobnicate": 1}),
    ("/tokenize", {"prompt": "hi", "frobnicate": 1}),
    ("/detokenize", {"tokens": [5], "frobnicate": 1}),
    ("/abort_request", {"rid": "nothing-runs-with-this-id", "frobnicate": 1}),
])
def test_every_json_route_ignores_unknown_fields(gw_url, path, body):
    status, got = http(gw_url + path, "POST", body)
    assert status == 200, got


def test_ignored_field_names_are_bounded_in_metrics(own_url):
    """A client can invent any key: past 64 distinct names they are counted under one label."""
    for i in range(70):
        assert http(own_url + "/tokenize", "POST", {"prompt": "hi", f"made_up_{i}": 1})[0] == 200
    counts = _ignored_counts(own_url)
    assert len(counts) == 65 and counts["_other"] == 6


@pytest.mark.parametrize("extra, param", [
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
def test_known_fields_shoal_cannot_honour_are_400(oai, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **extra)
    assert e.value.body["param"] == param and "not supported" in e.value.body["message"]
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, modalities=["text"])
    assert r.choices[0].message.content is not None
