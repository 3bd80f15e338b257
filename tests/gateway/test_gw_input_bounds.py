"""Hostile prompt sizes: a text certainly past the context is refused (400 context_length_exceeded naming
the field) without being tokenized, a prompt batch past what could ever run is refused before any prompt is
encoded, a large body is encoded off the event loop (/health answers while it runs), and cache_salt and
stop_token_ids are bounded."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from gw_helpers import http

from runtime import ServerArgs
from runtime.gateway.server import serve_in_thread


@pytest.fixture(scope="module")
def big_url(gw_engine) -> Iterator[str]:
    """The session's engine behind a gateway that takes 16 MB bodies and queues at most 64 requests."""
    with serve_in_thread(gw_engine, ServerArgs(max_request_bytes=16 << 20, max_waiting_requests=64),
                         port=0) as handle:
        yield handle.url


@pytest.fixture()
def encodes(gw_engine, monkeypatch) -> list[int]:
    """Counts the tokenizer's encode calls (each call's text length)."""
    tok = gw_engine.tokenizer
    calls: list[int] = []
    real = tok.encode

    def counting(text: str, add_special_tokens: bool = True) -> list[int]:
        calls.append(len(text))
        return real(text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(tok, "encode", counting)
    return calls


def test_reach_is_a_lower_bound(gw_engine):
    tok = gw_engine.tokenizer
    reach = tok.reach
    assert reach is not None and reach.chars == max(len(t) for t in tok.hf.get_vocab())
    for text in ("x" * 5000, "日本語 " * 900, "🙂" * 3000, "Émile crème " * 500):
        assert len(tok.encode(text, add_special_tokens=False)) >= len(text) / reach.chars


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x" * 2_000_000, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["hi", "x" * 2_000_000], "max_tokens": 1}, "prompt"),
    ("/tokenize", {"prompt": "x" * 2_000_000}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2_000_000}]}, "messages"),
    ("/v1/responses", {"input": "x" * 2_000_000}, "input"),
    ("/generate", {"text": "x" * 2_000_000, "sampling_params": {"max_new_tokens": 1}}, "text"),
])
def test_past_the_context_is_refused_without_encoding(big_url, encodes, path, body, param):
    t = time.monotonic()
    status, r = http(big_url + path, "POST", body)
    assert status == 400, r
    assert r["error"]["code"] == "context_length_exceeded" and r["error"]["param"] == param
    assert all(n < 100_000 for n in encodes), encodes  # the huge text never reached the tokenizer
    assert time.monotonic() - t < 5


def test_truncated_prompt_is_still_encoded(big_url, gw_engine):
    status, r = http(big_url + "/v1/completions", "POST",
                     {"prompt": "x" * 20_000, "max_tokens": 1, "truncate_prompt_tokens": 8})
    assert status == 200, r
    assert r["usage"]["prompt_tokens"] == 8


def test_prompt_batch_counted_before_encoding(big_url, encodes):
    status, r = http(big_url + "/v1/completions", "POST", {"prompt": ["hello"] * 65, "max_tokens": 1})
    assert status == 400 and r["error"]["param"] == "prompt" and "65 prompts" in r["error"]["message"], r
    status, r = http(big_url + "/v1/completions", "POST", {"prompt": ["hello"] * 40, "max_tokens": 1, "n": 2})
    assert status == 400 and "40 prompts" in r["error"]["message"], r
    status, r = http(big_url + "/v1/completions", "POST", {"prompt": [[5, 6]] * 100_000, "max_tokens": 1})
    assert status == 400 and r["error"]["param"] == "prompt", r
    status, r = http(big_url + "/generate", "POST", {"input_ids": [[5, 6]] * 100_000})
    assert status == 400 and r["error"]["param"] == "input_ids", r
    status, r = http(big_url + "/generate", "POST", {"text": ["hello"] * 65})
    assert status == 400 and r["error"]["param"] == "text" and "65 prompts" in r["error"]["message"], r
    status, r = http(big_url + "/generate", "POST", {"text": ["hello"] * 40, "sampling_params": {"n": 2}})
    assert status == 400 and "40 prompts" in r["error"]["message"], r  # each makes n requests, as on completions
    assert encodes == []


def test_large_input_is_encoded_off_the_loop(big_url, gw_engine, monkeypatch):
    """A slow encode of a large body runs while /health answers at once; a small one stays on the loop."""
    tok = gw_engine.tokenizer
    real = tok.encode
    threads: list[str] = []

    def slow(text: str, add_special_tokens: bool = True) -> list[int]:
        threads.append(threading.current_thread().name)
        if len(text) > 1000:
            time.sleep(1.5)
        return real(text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(tok, "encode", slow)
    out: dict[str, object] = {}
    # Past the tiny model's context as text (its reach bounds 6,656 characters), so cut to its last 8 tokens
    body = {"prompt": "ab " * 30_000, "max_tokens": 1, "truncate_prompt_tokens": 8}
    big = threading.Thread(target=lambda: out.setdefault("r", http(big_url + "/v1/completions", "POST", body)))
    big.start()
    time.sleep(0.3)
    t = time.monotonic()
    assert http(big_url + "/health")[0] == 200
    assert time.monotonic() - t < 0.5  # not behind the 1.5 s encode
    big.join()
    status, r = out["r"]
    assert status == 200 and r["usage"]["prompt_tokens"] == 8, r
    assert threads[0].startswith("shoal-tokenize")
    http(big_url + "/tokenize", "POST", {"prompt": "small"})
    assert not threads[-1].startswith("shoal-tokenize")


def test_cache_salt_is_bounded(big_url):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})):
        status, r = http(big_url + path, "POST", {**body, "cache_salt": "s" * 257})
        assert status == 400 and r["error"]["param"] == "cache_salt", r
        assert http(big_url + path, "POST", {**body, "cache_salt": "s" * 256})[0] == 200


def test_stop_token_ids_count_is_bounded(big_url):
    body = {"prompt": "hi", "max_tokens": 2, "min_tokens": 1}
    status, r = http(big_url + "/v1/completions", "POST", {**body, "stop_token_ids": list(range(129))})
    assert status == 400 and r["error"]["param"] == "stop_token_ids", r
    assert http(big_url + "/v1/completions", "POST", {**body, "stop_token_ids": list(range(128))})[0] == 200
