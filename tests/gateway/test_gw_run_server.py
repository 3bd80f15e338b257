"""`shoal serve` end to end in a subprocess: the port answers (503, then 200) while the model loads, a
"ready" line names the URL, a request works, and SIGTERM / SIGINT stop it cleanly (exit code 0)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gw_helpers import http

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_ready_request_and_clean_stop(tiny_llama, tmp_path, sig):
    port = _free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--model-path", str(tiny_llama),
                                 "--device", "cpu", "--max-total-tokens", "2048", "--port", str(port),
                                 "--served-model-name", "tiny"], stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        statuses = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                statuses.append(http(url + "/health", timeout=5)[0])
            except OSError:  # not listening yet (imports)
                pass
            if statuses and statuses[-1] == 200:
                break
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        assert statuses and statuses[-1] == 200, log.read_text()
        assert set(statuses) <= {200, 503}
        status, body = http(url + "/v1/completions", "POST", {"model": "tiny", "prompt": "Hi", "max_tokens": 3})
        assert status == 200 and body["model"] == "tiny"
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert f"ready: serving model 'tiny' at http://127.0.0.1:{port}" in text, text
    assert "stopped" in text
