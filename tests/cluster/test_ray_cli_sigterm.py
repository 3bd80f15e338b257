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


def _serve(tiny_llama: Path, log: Path, *extra: str, new_session: bool = False) -> tuple[subprocess.Popen, int]:
    """`shoal serve --use-ray` on a free port, its output in log (new_session: it leads its own process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--model-path", str(tiny_llama),
                                 "--use-ray", "--device", "cpu", "--max-total-tokens", "2048", "--port", str(port),
                                 *extra], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=new_session)
    return proc, port


def test_sigterm_drains_streams_and_exits_0(tiny_llama, tmp_path):
    log = tmp_path / "serve.log"
    proc, port = _serve(tiny_llama, log)
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


def test_sigterm_while_the_replicas_load_exits_0(tiny_llama, tmp_path):
    """A pod stopped during the model load: our handler, not Ray's (a crash dump and exit 1), ends the
    launch cleanly and takes the local cluster down."""
    log = tmp_path / "serve.log"
    proc, _ = _serve(tiny_llama, log, "--dp-size", "2")
    try:
        deadline = time.monotonic() + 120
        while "Ray is up; loading the replicas" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)  # the replicas load
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 0 and "SIGTERM received" not in text, text[-3000:]


def test_sigterm_to_the_process_group_exits_0_at_once(tiny_llama, tmp_path):
    """`timeout`, systemd's default stop and a container's end signal the whole group: the local Ray cluster's
    processes stop with the CLI (not the actors: Ray gives each its own group), so the drain cannot be answered.
    The CLI used to wait shutdown_timeout_s + 30 s for it, then log a GetTimeoutError traceback."""
    log = tmp_path / "serve.log"
    proc, _ = _serve(tiny_llama, log, new_session=True)
    try:
        deadline = time.monotonic() + 150
        while "Shoal is ready" not in log.read_text():  # the CLI watches the actor (a 200 from /health comes sooner)
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGTERM)
        start = time.monotonic()
        rc = proc.wait(timeout=20)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 0 and "Traceback" not in text, text[-3000:]
    assert "the stop signal reached the whole process group" in text, text[-3000:]
    assert took < 15, took


def test_a_gateway_actor_start_error_is_one_line(tiny_llama, tmp_path):
    """A busy --port fails inside the gateway actor; the error travels back (it pickles) as one line
    naming the flag, exit 2, instead of Ray's 'Failed to deserialize exception' traceback."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-m", "runtime", "serve", "--model-path", str(tiny_llama),
                               "--use-ray", "--device", "cpu", "--max-total-tokens", "2048", "--port", str(port)],
                              capture_output=True, text=True, env=env, cwd=REPO, timeout=180)
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last.startswith("shoal: error: the gateway actor did not start: ServerArgsError: --port"), last
