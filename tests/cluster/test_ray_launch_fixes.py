"""`shoal serve` on Ray as an operator runs it: which cluster it joins ($RAY_ADDRESS, vLLM's rule for a
running `ray start` cluster), the gateway actor's port open at once (503 while the replicas load; a busy
port fails in seconds), the CLI ending non-zero when its gateway actor dies, and the actors' logs at
--log-level with timestamps and no progress bar."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import requests

from runtime.cluster.launch import RayAddress, RayStart, choose_ray_address, running_local_cluster
from runtime.config import ServerArgs


def _no_lookup() -> str | None:
    raise AssertionError("looked for a running cluster where none may be joined")


@pytest.mark.parametrize("flag, env, join_running, running, expected", [
    ("10.0.0.5:6379", {"RAY_ADDRESS": "10.0.0.9:6379"}, True, "127.0.0.1:6379", RayAddress("10.0.0.5:6379", "--address")),
    ("auto", {}, False, None, RayAddress("auto", "--address")),
    ("local", {"RAY_ADDRESS": "10.0.0.9:6379"}, False, None, RayAddress(None, "--address")),
    (None, {"RAY_ADDRESS": "10.0.0.9:6379"}, False, None, RayAddress("10.0.0.9:6379", "$RAY_ADDRESS")),
    (None, {"RAY_ADDRESS": " ray://head:10001 "}, True, "127.0.0.1:6379", RayAddress("ray://head:10001", "$RAY_ADDRESS")),
    (None, {"RAY_ADDRESS": "local"}, False, None, RayAddress(None, "$RAY_ADDRESS")),
    (None, {"RAY_ADDRESS": ""}, False, None, RayAddress(None, "no --address or $RAY_ADDRESS")),  # --use-ray: its own
    (None, {}, True, "127.0.0.1:6379", RayAddress("127.0.0.1:6379", "the local cluster `ray start` left running")),
    (None, {}, True, None, RayAddress(None, "no running cluster found")),  # vLLM's backend, nothing running
])
def test_choose_ray_address(flag, env, join_running, running, expected):
    lookup = (lambda: running) if join_running else _no_lookup
    got = choose_ray_address(flag, env, join_running, lookup)
    assert got == expected and got.joins == (expected.address is not None)


def test_ray_start_modes():
    assert [(s.owned, s.fixed) for s in RayStart] == [(False, False), (True, False), (True, True)]


def test_running_local_cluster_reads_ray_starts_file(monkeypatch, tmp_path):
    """`ray start --head` records its address under $RAY_TMPDIR/ray; a head that no longer answers (a
    crashed cluster's file) counts as none, so Shoal starts its own instead of retrying it for minutes."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert running_local_cluster() is None
    record = tmp_path / "ray" / "ray_current_cluster"
    record.parent.mkdir()
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen()
        record.write_text(f"127.0.0.1:{head.getsockname()[1]}")
        assert running_local_cluster() == f"127.0.0.1:{head.getsockname()[1]}"
    assert running_local_cluster() is None  # closed now


def test_tp_worker_actor_logs_at_the_servers_level():
    from runtime.cluster.tp_rank import RankSpec
    from runtime.cluster.tp_worker_actor import TpWorkerActor

    logs = [logging.getLogger(name) for name in ("runtime", "shoal")]
    saved = [(log.level, list(log.handlers), log.propagate) for log in logs]
    try:
        TpWorkerActor(ServerArgs(model_path="/x", log_level="debug"), "/x", RankSpec(1, 2, False))
        assert logs[0].getEffectiveLevel() == logging.DEBUG and logs[0].handlers
    finally:  # as they were: other tests' caplog reads records propagated to the root
        for log, (level, handlers, propagate) in zip(logs, saved):
            log.setLevel(level)
            log.handlers[:] = handlers
            log.propagate = propagate


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _actor_log(actor_class: str) -> str:
    """The stderr of this Ray session's newest `actor_class` actor."""
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    files = [f for f in logs.glob("worker-*.err") if f":actor_name:{actor_class}" in f.read_text()[:300]]
    return max(files, key=lambda f: f.stat().st_mtime).read_text()


@pytest.mark.ray
def test_a_busy_port_fails_before_any_replica_loads(ray_local, tiny_llama):
    from runtime.cluster.launch import launch_gateway_actor
    from runtime.errors import EngineUnavailableError

    args = ServerArgs(model_path=str(tiny_llama), use_ray=True, device="cpu", max_total_tokens=1024)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailableError, match="did not start: ServerArgsError: --port: cannot listen"):
            launch_gateway_actor(args, port=held.getsockname()[1])
    assert time.monotonic() - t0 < 10  # an actor's start, not a replica's load


@pytest.mark.ray
def test_serve_answers_503_while_loading_and_exits_when_its_actor_dies(ray_local, tiny_llama, monkeypatch):
    """serve_gateway_actor: the port answers 503 engine_not_ready before the replica is up; a kill -9 of the
    gateway actor ends the launcher with EngineUnavailableError (the CLI: exit 2) and an ERROR line, and frees
    the placement group the actor had reserved."""
    import ray

    import runtime.cluster.launch as launch
    from runtime.entrypoints.gateway_launcher import serve_gateway_actor
    from runtime.errors import EngineUnavailableError

    handles = []
    real_launch = launch.launch_gateway_actor
    monkeypatch.setattr(launch, "launch_gateway_actor", lambda *a, **k: handles.append(real_launch(*a, **k)) or handles[-1])
    records: list[logging.LogRecord] = []
    catcher = logging.Handler()
    catcher.emit = records.append
    logging.getLogger("shoal.gateway").addHandler(catcher)

    port = _free_port()
    args = ServerArgs(model_path=str(tiny_llama), use_ray=True, device="cpu", max_total_tokens=1024, port=port)
    stop, outcome = threading.Event(), {}

    def run() -> None:
        try:
            serve_gateway_actor(args, stop)
        except BaseException as e:
            outcome["error"] = e

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    url = f"http://127.0.0.1:{port}"
    statuses: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not statuses or statuses[-1] != 200:
            try:
                r = requests.get(url + "/health", timeout=5)
                statuses.append(r.status_code)
                if r.status_code == 503:
                    assert "engine_not_ready" in r.text, r.text  # as the in-process server says
            except requests.ConnectionError:
                pass
            assert runner.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.2)
        assert 503 in statuses  # open while the replica loaded (the launch takes seconds here)
        while not handles:  # launch_gateway_actor returns once the replica is up
            time.sleep(0.1)
        actor_pid = ray.get(handles[0].pid.remote())
        os.kill(actor_pid, signal.SIGKILL)
        runner.join(30)
        assert not runner.is_alive()
    finally:
        stop.set()
        runner.join(60)
        logging.getLogger("shoal.gateway").removeHandler(catcher)
    assert isinstance(outcome.get("error"), EngineUnavailableError), outcome
    assert str(outcome["error"]).startswith("the gateway actor died: ")
    assert any(r.levelno == logging.ERROR and "the gateway actor died" in r.getMessage() for r in records)
    with pytest.raises(ValueError):  # freed, not held for the rest of this driver's job
        ray.util.get_placement_group(launch.replica_group_name(0, actor_pid))
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health", timeout=5)
    # The actors logged at INFO with timestamps and their logger's name; no progress bar in any actor's log.
    gateway_log = _actor_log("GatewayActor")
    assert "INFO runtime.cluster.launch: replica group 0 up" in gateway_log, gateway_log[-2000:]
    assert "Loading safetensors shards" not in _actor_log("SchedulerActor")


def test_a_deliberate_shutdown_elsewhere_is_no_death(ray_local):
    """watch_gateway tells a shutdown() by another holder of the handle (a clean exit for the CLI) from a death."""
    import ray

    from runtime.entrypoints.gateway_launcher import SHUT_DOWN_ELSEWHERE, watch_gateway

    @ray.remote(num_cpus=0, max_concurrency=2)
    class Stoppable:
        def __init__(self) -> None:
            self.stopped = threading.Event()

        def wait_stopped(self) -> None:
            self.stopped.wait()

        def shutdown(self) -> None:
            self.stopped.set()

    actor = Stoppable.remote()
    threading.Timer(0.3, lambda: actor.shutdown.remote()).start()
    assert watch_gateway(actor, threading.Event(), poll_s=0.05) == SHUT_DOWN_ELSEWHERE
    stop, running = threading.Event(), Stoppable.remote()
    stop.set()
    assert watch_gateway(running, stop) is None
    for a in (actor, running):
        ray.kill(a)


@pytest.mark.parametrize("flag, env", [(None, {"RAY_ADDRESS": "http://127.0.0.1:8265"}), ("https://head:8265", {})])
def test_a_dashboard_url_is_refused_by_name(flag, env):
    """The Jobs CLI's $RAY_ADDRESS is the dashboard's URL, which no ray.init() joins: said so, not 'nothing answers'."""
    from runtime.errors import EngineUnavailableError

    with pytest.raises(EngineUnavailableError, match="dashboard's \\(Jobs API\\) URL"):
        choose_ray_address(flag, env, False, _no_lookup)
