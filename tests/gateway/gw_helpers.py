"""HTTP helpers of the gateway tests: raw requests, SSE parsing, the wait for a full KV pool, slower
engine steps."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from runtime import Engine, ServerArgs

GATEWAY_ARGS = ServerArgs(max_n=4, max_request_bytes=64 * 1024)


def http(url: str, method: str = "GET", body: Any = None, headers: dict[str, str] | None = None,
         timeout: float = 60) -> tuple[int, Any]:
    """(status, parsed JSON body or text) for a raw request; body: dict (sent as JSON) or bytes."""
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json",
                                                                        **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def raw(url: str, method: str = "GET", headers: dict[str, str] | None = None,
        body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body bytes) as sent: headers and bodies a test checks byte for byte."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def last_token_embedder(src: Path, path: Path) -> Path:
    """A copy of the checkpoint at src as a sentence-transformers model: last-token pooling, then Normalize."""
    shutil.copytree(src, path)
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True,
                                                               "pooling_mode_mean_tokens": False}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    return path


def sse_events(raw: str) -> list[Any]:
    """Parsed `data:` payloads of an SSE body, "[DONE]" kept as the string."""
    out = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def generation_error(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The error object of a POST that fails: the 400's body, or in a stream (200 headers already sent)
    the error event."""
    status, r = http(url, "POST", body)
    if body.get("stream"):
        assert status == 200
        r = next(e for e in sse_events(r) if e != "[DONE]" and "error" in e)
    else:
        assert status == 400, r
    return r["error"]


def wait_kv_full(engine: Engine, timeout_s: float = 5.0) -> None:
    """Polls until nothing runs or waits and every KV slot is free or evictable cache; asserts it."""
    deadline = time.monotonic() + timeout_s
    while True:
        with engine.scheduler.lock:
            kv = engine.scheduler.kv
            idle = not engine.scheduler.reqs
            full = kv.allocator.available_size() + kv.cache.evictable_size() == kv.size
            engine.scheduler.check_kv_invariant()
        if idle and full:
            return
        assert time.monotonic() < deadline, "the KV pool did not return to full"
        time.sleep(0.05)


def slow_steps(engine: Engine, monkeypatch: Any, seconds: float) -> None:
    """Makes each engine step take `seconds` longer, so requests reliably outlive client actions (or a
    prefill takes measurably long)."""
    run_batch = engine.worker.run_batch

    def slow_run_batch(batch: Any) -> Any:
        time.sleep(seconds)
        return run_batch(batch)

    monkeypatch.setattr(engine.worker, "run_batch", slow_run_batch)
