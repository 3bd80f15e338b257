"""POST /v1/embeddings on an embedding server (tiny Qwen3, last-token pooling, normalized), through the
openai SDK (float, and its default base64) and raw HTTP: token-id inputs, vLLM's messages form,
`dimensions` (400 unless the model is Matryoshka), the errors, the generation routes refused on an
embedding server and the embeddings route on a generation one, and the KV pool full afterwards; SGLang's
POST /encode; the gateway's admission (--max-concurrent-requests' 429, the shutdown drain's 503) and
metrics for embedding batches."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from gw_helpers import GATEWAY_ARGS, http, last_token_embedder, wait_kv_full

from runtime import Engine
from runtime.config import ServerArgs
from runtime.gateway.app import build_app, gateway_state
from runtime.gateway.drain import drain
from runtime.gateway.server import ServerHandle

TEXTS = ["The quick brown fox jumps over the lazy dog. The capital of France is Paris.", "Hello", "emoji: 🙂"]


@pytest.fixture(scope="module")
def emb_engine(tiny_model_dirs, tmp_path_factory) -> Iterator[Engine]:
    path: Path = tmp_path_factory.mktemp("gw_emb") / "qwen3"
    last_token_embedder(tiny_model_dirs["qwen3"], path)
    engine = Engine(str(path), device="cpu", dtype="float32", is_embedding=True, chunked_prefill_size=16,
                    log_level="warning")
    yield engine
    engine.shutdown()


def vectors(engine: Engine, *args, **kwargs) -> list[float] | list[list[float]]:
    """Engine.encode's vectors (it answers in SGLang's {"embedding", "meta_info"} shape)."""
    out = engine.encode(*args, **kwargs)
    return [o["embedding"] for o in out] if isinstance(out, list) else out["embedding"]


def serve(engine: Engine, args: ServerArgs) -> ServerHandle:
    return ServerHandle(build_app(engine, args), "127.0.0.1", 0)


@pytest.fixture(scope="module")
def emb_server(emb_engine) -> Iterator[ServerHandle]:
    with serve(emb_engine, GATEWAY_ARGS) as handle:
        yield handle


@pytest.fixture(scope="module")
def emb_oai(emb_server):
    import openai

    return openai.OpenAI(base_url=emb_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_sdk_float_and_base64(emb_engine, emb_oai):
    want = vectors(emb_engine, TEXTS)
    floats = emb_oai.embeddings.create(model="qwen3", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    for d, w in zip(floats.data, want):
        torch.testing.assert_close(torch.tensor(d.embedding), torch.tensor(w))
    n_tokens = sum(len(emb_engine.tokenizer.encode(t)) for t in TEXTS)
    assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (n_tokens, n_tokens)
    default = emb_oai.embeddings.create(model="qwen3", input=TEXTS)  # the SDK asks for base64 and decodes it
    for d, w in zip(default.data, want):
        torch.testing.assert_close(torch.tensor(d.embedding), torch.tensor(w))
    wait_kv_full(emb_engine)


def test_raw_base64_is_little_endian_float32(emb_engine, emb_server):
    status, body = http(emb_server.url + "/v1/embeddings", "POST", {"input": "Hello", "encoding_format": "base64"})
    assert status == 200, body
    raw = base64.b64decode(body["data"][0]["embedding"])
    got = struct.unpack(f"<{len(raw) // 4}f", raw)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(vectors(emb_engine, "Hello")))
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding" and body["model"] == "qwen3"


def test_token_id_inputs_and_messages(emb_engine, emb_oai, emb_server):
    ids = [emb_engine.tokenizer.encode(t) for t in TEXTS]
    one = emb_oai.embeddings.create(model="qwen3", input=ids[0], encoding_format="float")
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), torch.tensor(vectors(emb_engine, TEXTS[0])))
    many = emb_oai.embeddings.create(model="qwen3", input=ids, encoding_format="float")
    assert len(many.data) == 3 and many.usage.prompt_tokens == sum(map(len, ids))
    messages = [{"role": "user", "content": "Hello"}]
    status, body = http(emb_server.url + "/v1/embeddings", "POST", {"messages": messages})
    assert status == 200, body
    chat_ids = emb_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]),
                               torch.tensor(vectors(emb_engine, input_ids=chat_ids)))


def test_dimensions(emb_engine, emb_oai, emb_server):
    import openai

    with pytest.raises(openai.BadRequestError, match="matryoshka") as e:
        emb_oai.embeddings.create(model="qwen3", input="Hello", dimensions=16)
    assert e.value.body["param"] == "dimensions"
    full = vectors(emb_engine, "Hello")
    emb_engine.pooling = dataclasses.replace(emb_engine.pooling, is_matryoshka=True)  # as if config.json said so
    try:
        short = emb_oai.embeddings.create(model="qwen3", input="Hello", dimensions=16, encoding_format="float")
        torch.testing.assert_close(torch.tensor(short.data[0].embedding),
                                   torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0))
        status, body = http(emb_server.url + "/v1/embeddings", "POST", {"input": "Hello", "dimensions": 65})
        assert status == 400 and body["error"]["param"] == "dimensions", body
    finally:
        del emb_engine.pooling  # back to what the model folder says


def test_sentence_transformers_prompts_not_applied_by_the_server(emb_engine, emb_server):
    """As vLLM's server: the text is embedded as sent, though Engine.encode applies default_prompt_name."""
    plain = vectors(emb_engine, "Hello")
    emb_engine.pooling = dataclasses.replace(emb_engine.pooling, prompts={"query": "query: "},
                                             default_prompt_name="query")  # as if the model folder said so
    try:
        assert not torch.allclose(torch.tensor(vectors(emb_engine, "Hello")), torch.tensor(plain))
        for path, payload, key in (("/v1/embeddings", {"input": "Hello"}, "data"), ("/encode", {"text": "Hello"}, "")):
            status, body = http(emb_server.url + path, "POST", payload)
            assert status == 200, body
            got = body["data"][0]["embedding"] if key else body["embedding"]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(plain))
    finally:
        del emb_engine.pooling


@pytest.mark.parametrize("payload, param, words", [
    ({"input": []}, "input", "not empty"),
    ({"input": ["a", 3]}, "input", "not a mix"),
    ({"input": [[1, 2], []]}, "input", "non-empty"),
    ({"input": [10**9]}, "input", "outside the vocabulary"),
    ({"input": "Hello", "encoding_format": "bytes64"}, "encoding_format", "float, base64"),
    ({"input": "Hello", "messages": [{"role": "user", "content": "x"}]}, "input", "either input or messages"),
    ({}, "input", "either input or messages"),
    ({"input": "Hello", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 or a positive"),
])
def test_bad_requests(emb_server, payload, param, words):
    status, body = http(emb_server.url + "/v1/embeddings", "POST", payload)
    assert status == 400, body
    assert body["error"]["param"] == param and words in body["error"]["message"], body


def test_too_long_input_and_truncation(emb_engine, emb_server):
    ids = (emb_engine.tokenizer.encode(TEXTS[0]) * 40)[:600]
    status, body = http(emb_server.url + "/v1/embeddings", "POST", {"input": ids})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "512" in body["error"]["message"] and "600" in body["error"]["message"]
    status, body = http(emb_server.url + "/v1/embeddings", "POST", {"input": ids, "truncate_prompt_tokens": 20})
    assert status == 200 and body["usage"]["prompt_tokens"] == 20, body
    torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]),
                               torch.tensor(vectors(emb_engine, input_ids=ids[-20:])))
    status, body = http(emb_server.url + "/v1/embeddings", "POST", {"input": "x", "model": "other"})
    assert status == 404, body
    wait_kv_full(emb_engine)
    with emb_engine.scheduler.lock:
        emb_engine.scheduler.check_kv_invariant()


@pytest.mark.parametrize("path, payload", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
    ("/generate", {"text": "Hello"}),
])
def test_generation_routes_refused_on_embedding_server(emb_server, path, payload):
    status, body = http(emb_server.url + path, "POST", payload)
    assert status == 400 and "embedding model" in body["error"]["message"], body


def test_health_generate_embeds(emb_server):
    status, body = http(emb_server.url + "/health_generate")
    assert status == 200 and body == {"status": "ok"}, body


def test_embeddings_refused_on_generation_server(gw_url):
    status, body = http(gw_url + "/v1/embeddings", "POST", {"input": "Hello"})
    assert status == 400 and "--is-embedding" in body["error"]["message"], body


def test_sglang_encode_route(emb_engine, emb_server):
    url = emb_server.url + "/encode"
    status, body = http(url, "POST", {"text": TEXTS[0], "rid": "mine"})
    assert status == 200, body
    torch.testing.assert_close(torch.tensor(body["embedding"]), torch.tensor(vectors(emb_engine, TEXTS[0])))
    n = len(emb_engine.tokenizer.encode(TEXTS[0]))
    assert body["meta_info"]["id"] == "mine" and body["meta_info"]["prompt_tokens"] == n, body
    ids = [emb_engine.tokenizer.encode(t) for t in TEXTS[1:]]
    status, body = http(url, "POST", {"input_ids": ids})  # a batch: one answer per input, in order
    assert status == 200 and len(body) == 2, body
    for b, want in zip(body, vectors(emb_engine, TEXTS[1:])):
        torch.testing.assert_close(torch.tensor(b["embedding"]), torch.tensor(want))
    # SGLang's batch rid: one per input, answered in order; a wrong count or a repeat is a 400 naming rid
    status, body = http(url, "POST", {"text": TEXTS[1:], "rid": ["r-a", "r-b"]})
    assert status == 200 and [b["meta_info"]["id"] for b in body] == ["r-a", "r-b"], body
    status, body = http(url, "POST", {"text": TEXTS[1], "rid": ["only"]})
    assert status == 200 and body["meta_info"]["id"] == "only", body
    for rid in (["r-a"], ["r-a", "r-b", "r-c"], ["r-a", "r-a"], ["r-a", ""]):
        status, body = http(url, "POST", {"text": TEXTS[1:], "rid": rid})
        assert status == 400 and body["error"]["param"] == "rid", (rid, body)
    status, body = http(url, "POST", {"text": "x", "input_ids": [1]})
    assert status == 400 and body["error"]["param"] == "text", body
    status, body = http(url, "POST", {"input_ids": [1] * 513})
    assert status == 400 and body["error"]["param"] == "input_ids", body
    assert body["error"]["code"] == "context_length_exceeded" and "512" in body["error"]["message"]
    status, body = http(url, "POST", {"input_ids": [1] * 512})  # exactly the context fits (as vLLM)
    assert status == 200 and body["meta_info"]["prompt_tokens"] == 512, body


def gate_steps(engine: Engine, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Each engine step waits for `release`; `entered` is set once one is waiting."""
    run_batch = engine.worker.run_batch
    entered, release = threading.Event(), threading.Event()

    def gated(batch):
        entered.set()
        assert release.wait(30)
        return run_batch(batch)

    monkeypatch.setattr(engine.worker, "run_batch", gated)
    return entered, release


def metric(url: str, name: str) -> float:
    _, text = http(url + "/metrics")
    return float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith(name + " ")))


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(result=fn()))
    t.start()
    return t, out


COUNTED = ("shoal:e2e_request_latency_seconds_count", "shoal:prompt_tokens_total", "shoal:requests_rejected_total")


def test_admission_limits_and_metrics(emb_engine, monkeypatch):
    import requests

    ids = [emb_engine.tokenizer.encode(t) for t in TEXTS[:2]]
    with serve(emb_engine, GATEWAY_ARGS.replace(max_concurrent_requests=2)) as server:
        url = server.url
        before = [metric(url, m) for m in COUNTED]
        entered, release = gate_steps(emb_engine, monkeypatch)
        first, out = in_thread(lambda: http(url + "/v1/embeddings", "POST", {"input": ids}))
        assert entered.wait(30)  # its two inputs are in flight: the server is at its limit
        for path, payload in (("/v1/embeddings", {"input": ["Hello"]}), ("/encode", {"text": "Hello"})):
            r = requests.post(url + path, json=payload, timeout=30)
            assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
            assert "2 concurrent requests" in r.json()["error"]["message"]
        r = requests.post(url + "/v1/embeddings", json={"input": ["a", "b", "c"]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert "--max-concurrent-requests" in r.json()["error"]["message"]
        release.set()
        first.join(30)
        assert out["result"][0] == 200, out
        assert gateway_state(server.app).active == 0 and not gateway_state(server.app).inflight
        after = [metric(url, m) for m in COUNTED]
        # two inputs finished (e2e latency and prompt tokens counted), two batches refused with 429
        assert [a - b for a, b in zip(after, before)] == [2, sum(map(len, ids)), 2]
        assert http(url + "/v1/embeddings", "POST", {"input": ["a", "b"]})[0] == 200  # the slots are back
    wait_kv_full(emb_engine)


def test_drain_aborts_embeddings_in_flight(emb_engine, monkeypatch):
    with serve(emb_engine, GATEWAY_ARGS) as server:
        url, state = server.url, gateway_state(server.app)
        assert http(url + "/v1/embeddings", "POST", {"input": "warm"})[0] == 200  # admission has its stats
        entered, release = gate_steps(emb_engine, monkeypatch)
        busy, _ = in_thread(lambda: emb_engine.encode("the engine is busy with this one"))
        assert entered.wait(30)
        waiting, out = in_thread(lambda: http(url + "/v1/embeddings", "POST", {"input": "Hello"}))
        deadline = time.monotonic() + 30
        while not any(rid.startswith("embd-") for rid in list(emb_engine._consumers)):  # submitted, queued
            assert time.monotonic() < deadline
            time.sleep(0.01)
        drained = asyncio.run_coroutine_threadsafe(drain(server.app, 0.0), server._loop)
        while not state.shutting_down:
            time.sleep(0.01)
        status, body = http(url + "/v1/embeddings", "POST", {"input": "Hello"})
        assert status == 503 and body["error"]["code"] == "engine_not_ready", body
        release.set()
        assert drained.result(30) == 1  # the queued embedding was aborted
        waiting.join(30)
        busy.join(30)
        status, body = out["result"]
        assert status == 503 and body["error"]["code"] == "request_aborted", body
        assert state.active == 0
    wait_kv_full(emb_engine)


def test_vllm_pooling_route(emb_engine, emb_server, gw_url):
    """vLLM's POST /pooling: /v1/embeddings' body and vectors, answered as data[i] = {index, object: "pooling",
    data}; base64 as there; a 400 naming model on a generation server."""
    status, body = http(emb_server.url + "/pooling", "POST", {"model": "qwen3", "input": TEXTS})
    assert status == 200, body
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["pooling"] * 3
    for d, w in zip(body["data"], vectors(emb_engine, TEXTS)):
        torch.testing.assert_close(torch.tensor(d["data"]), torch.tensor(w))
    status, b64 = http(emb_server.url + "/pooling", "POST", {"input": "Hello", "encoding_format": "base64"})
    raw = base64.b64decode(b64["data"][0]["data"])
    torch.testing.assert_close(torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)),
                               torch.tensor(vectors(emb_engine, "Hello")))
    status, err = http(gw_url + "/pooling", "POST", {"input": "Hello"})
    assert status == 400 and err["error"]["param"] == "model", err
    wait_kv_full(emb_engine)
