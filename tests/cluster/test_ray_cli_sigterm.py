"""`shoal serve` on Ray stopped by SIGTERM (docker stop, a Kubernetes pod's end): in-flight streams finish,
the process exits 0. ray.init installs its own SIGTERM handler (sys.exit), which used to replace ours and
cut the streams mid-body with a non-zero exit."""

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
from ray_helpers import wait_healthy

pytestmark = pytest.mark.ray
REPO = Path(__file__).resolve().parents[2]


def test_sigterm_drains_streams_and_exits_0(tiny_llama, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--model-path", str(tiny_llama),
                                 "--use-ray", "--device", "cpu", "--max-total-tokens", "2048", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 150, alive=lambda: proc.poll() is None, why=lambda: log.read_text()[-3000:])
        events: list[str] = []

        def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True,
                    "temperature": 0}
            with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
                events.extend(line.decode() for line in r.iter_lines() if line)

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(1.0)  # the stream is under way
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, log.read_text()[-3000:]
    assert events and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # drained to its end, not cut
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 1
