"""`shoal serve --address host:port` where no Ray head listens: one line at once that names the address,
where ray.init alone retries the GCS connection for minutes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.cluster.launch import check_reachable
from runtime.errors import EngineUnavailableError

pytestmark = pytest.mark.ray
REPO = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


def test_check_reachable():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_reachable(f"127.0.0.1:{server.getsockname()[1]}")  # a listener: no error
        check_reachable(f"ray://127.0.0.1:{server.getsockname()[1]}")
    for address in ("auto", "local"):
        check_reachable(address)  # Ray's to resolve
    port = closed_port()
    with pytest.raises(EngineUnavailableError, match=f"nothing answers at 127.0.0.1:{port}"):
        check_reachable(f"127.0.0.1:{port}")


def test_serve_with_an_address_nobody_listens_at(tiny_llama):
    port = closed_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "runtime", "serve", "--model-path", str(tiny_llama),
                           "--address", f"127.0.0.1:{port}", "--device", "cpu", "--port", str(closed_port())],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert f"nothing answers at 127.0.0.1:{port}" in out and "Traceback" not in out, out[-3000:]
    assert time.monotonic() - start < 60, out[-3000:]  # seconds of start-up, not Ray's minutes of retries
