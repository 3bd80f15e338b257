"""`shoal serve` stopped with a stream in flight: the stream may run on for --shutdown-timeout-s, then it
is aborted and still ends properly (a last chunk with finish_reason "abort", then [DONE]), and the
process exits 0 soon after; a second Ctrl-C ends the drain at once. Before, shutdown waited for every
stream to run to its end (minutes for a long one), a second Ctrl-C was ignored, and the stream was cut
without a last chunk."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from gw_helpers import http

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tiny_llama: Path, log: Path, port: int, grace_s: float) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--model-path", str(tiny_llama),
                                 "--device", "cpu", "--max-total-tokens", "60000", "--context-length", "60000",
                                 "--port", str(port), "--shutdown-timeout-s", str(grace_s)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if http(f"http://127.0.0.1:{port}/health", timeout=5)[0] == 200:
                return proc
        except OSError:
            pass
        assert proc.poll() is None, log.read_text()
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(log.read_text())


@pytest.mark.parametrize("grace_s, signals", [(1.0, 1), (600.0, 2)], ids=["timeout", "second_signal"])
def test_stop_with_a_long_stream_in_flight(tiny_llama, tmp_path, grace_s, signals):
    port, log = _free_port(), tmp_path / "serve.log"
    proc = _serve(tiny_llama, log, port, grace_s)
    events: list[str] = []
    try:
        def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 50000, "ignore_eos": True, "stream": True}
            with requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, stream=True, timeout=120) as r:
                events.extend(line.decode()[len("data: "):] for line in r.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        while len(events) < 5:
            assert reader.is_alive() and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGINT)
        if signals == 2:
            time.sleep(1.0)  # the drain is under way: the stream still runs
            assert reader.is_alive()
            proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()
        took = time.monotonic() - stopped_at
        reader.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 45, log.read_text()  # not the 50,000 tokens' minutes
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "abort", last
    assert "aborting 1 request(s) still running at shutdown" in log.read_text()


def test_a_request_not_yet_in_flight_when_the_drain_begins_is_refused(tiny_llama):
    """A request still compiling its grammar when the drain starts was not in flight, so the drain neither
    waited for nor aborted it: once the drain has begun, tracking it is a 503 (it never reaches the engine)."""
    import asyncio

    from runtime import Engine
    from runtime.config import ServerArgs
    from runtime.gateway.app import build_app, gateway_state
    from runtime.gateway.drain import drain
    from runtime.gateway.errors import ApiError
    from runtime.messages import GenerateRequest
    from runtime.sampling.params import SamplingParams

    with Engine(str(tiny_llama), device="cpu", max_total_tokens=1024) as engine:
        app = build_app(engine, ServerArgs())
        assert asyncio.run(drain(app, 1.0)) == 0  # nothing in flight: returns at once
        req = GenerateRequest(rid="late", input_ids=[5, 6], sampling_params=SamplingParams(max_new_tokens=2))
        with pytest.raises(ApiError) as info:
            gateway_state(app).track("cmpl-late", [req])
        assert info.value.status == 503 and gateway_state(app).active == 0
