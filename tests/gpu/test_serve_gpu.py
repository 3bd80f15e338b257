"""`shoal serve` as a user runs it on one GPU: the default path there is Ray (a GatewayActor, a scheduler
actor holding the GPU). /health reports the replica, a completion works, CORS preflights and
/v1/models/{name} answer, and SIGTERM with a long stream in flight aborts it after --shutdown-timeout-s:
the stream ends with finish_reason "abort" and [DONE], and the process exits 0."""

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
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.ray,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the default Ray path)")]
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_on_one_gpu_health_cors_models_and_sigterm(tiny_llama, tmp_path):
    pytest.importorskip("ray")
    port, log = _free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--model-path", str(tiny_llama),
                                 "--served-model-name", "tiny", "--max-total-tokens", "60000", "--context-length",
                                 "60000", "--port", str(port), "--shutdown-timeout-s", "2"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)})
    events: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                health = requests.get(url + "/health", timeout=5)
                if health.status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        assert health.json() == {"status": "ok", "replicas_up": 1, "replicas": 1}
        r = requests.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4,
                                                        "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        pre = requests.options(url + "/v1/chat/completions", timeout=10, headers={
            "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 204 and pre.headers["Access-Control-Allow-Origin"] in ("*", "http://example.com")
        assert requests.get(url + "/v1/models/tiny", timeout=10).json()["id"] == "tiny"

        def stream() -> None:
            body = {"prompt": "Once", "max_tokens": 50000, "ignore_eos": True, "stream": True}
            with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as s:
                events.extend(line.decode()[len("data: "):] for line in s.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        while len(events) < 5:
            assert reader.is_alive(), log.read_text()[-4000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()[-4000:]
        reader.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort", events[-3:]
