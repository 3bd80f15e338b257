"""Ray Serve: the built app answers the openai client through Serve's HTTP proxy (plain and streaming), keyed
by $VLLM_API_KEY from the replica's runtime_env as `shoal serve` is by it (a keyless request is a 401),
stopping it drains (`serve.delete`: streams end with finish_reason "abort" within graceful_shutdown_timeout_s;
`serve shutdown`, which kills the proxy at once: the orphaned streams are aborted in one log line, no
traceback each), and the deploy/ manifests are valid — serve_config.yaml and rayservice.yaml against Ray's
own Serve schema with an import_path that resolves, cluster.yaml and the Dockerfile pointing at real entry
points."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
GRACEFUL_SHUTDOWN_TIMEOUT_S = 8.0  # the tests' budget: streams in flight may run 3 s of it, then are aborted
API_KEY = "serve-test-key"  # the replica's $VLLM_API_KEY: every request below but /health sends it
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deploy(tiny_llama: Path) -> None:
    from ray import serve

    from runtime.entrypoints.ray_serve import ShoalDeployment

    args = {"model_path": str(tiny_llama), "device": "cpu", "max_total_tokens": 60000, "context_length": 60000}
    keyed = {"runtime_env": {"env_vars": {"VLLM_API_KEY": API_KEY}}}  # as a serve_config.yaml's runtime_env sets it
    serve.run(ShoalDeployment.options(graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_TIMEOUT_S,
                                      ray_actor_options=keyed).bind(args),
              name="shoal", route_prefix="/")


@pytest.fixture(scope="module")
def serve_url(ray_session, tiny_llama):
    from ray import serve
    from ray_helpers import start_local_ray

    start_local_ray()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy(tiny_llama)
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def long_streams(url: str, n: int) -> tuple[list[threading.Thread], list[list[str]]]:
    """n streams of 50,000 tokens, each under way (a few events in) on return; each list gets its SSE
    payloads, or "cut: ..." when the connection broke."""
    import requests

    events: list[list[str]] = [[] for _ in range(n)]

    def stream(out: list[str]) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 50000, "ignore_eos": True, "stream": True}
        try:
            with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60, headers=AUTH) as r:
                out.extend(line.decode()[len("data: "):] for line in r.iter_lines() if line)
        except requests.RequestException as e:
            out.append(f"cut: {e!r}")

    threads = [threading.Thread(target=stream, args=(out,), daemon=True) for out in events]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while min(map(len, events)) < 3:
        assert time.monotonic() < deadline and all(t.is_alive() for t in threads), events
        time.sleep(0.05)
    return threads, events


def replica_log() -> str:
    """The stderr (Shoal's and Serve's lines) of the newest ShoalDeployment replica of this Ray session."""
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    files = [f for f in logs.glob("worker-*.err") if "ServeReplica:shoal:ShoalDeployment" in f.read_text()[:300]]
    return max(files, key=lambda f: f.stat().st_mtime).read_text()


def test_serve_answers_openai_client(serve_url, tiny_llama):
    import openai
    import requests

    assert requests.get(serve_url + "/health", timeout=30).status_code == 200
    client = openai.OpenAI(base_url=serve_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    assert model == tiny_llama.name
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    chunks = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=6,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    chat = client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError):  # the gateway's typed errors pass through the proxy
        client.completions.create(model=model, prompt="x", max_tokens=4, temperature=-1.0)


def test_vllm_api_key_in_the_runtime_env_keys_the_replica(serve_url):
    """The replica's runtime_env sets $VLLM_API_KEY and its args name no api_key: it is keyed, as `shoal
    serve` is (it ran open before); /health stays open for Serve's and load balancers' probes."""
    import requests

    assert requests.get(serve_url + "/v1/models", timeout=30).status_code == 401
    r = requests.get(serve_url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(serve_url + "/v1/models", headers=AUTH, timeout=30).status_code == 200
    assert requests.get(serve_url + "/health", timeout=30).status_code == 200


def test_deleting_the_app_drains_its_streams(serve_url):
    """A replica stopped with streams in flight (here the app deleted; a scale-down or redeploy likewise)
    drains as `shoal serve` does: they run on, then end with finish_reason "abort" and [DONE] before Serve's
    force-kill. Before, Serve waited for them until graceful_shutdown_timeout_s, then killed the replica and
    cut them mid-body."""
    from ray import serve

    threads, events = long_streams(serve_url, 2)
    started = time.monotonic()
    serve.delete("shoal")
    for t in threads:
        t.join(30)
    took = time.monotonic() - started
    for payloads in events:
        assert payloads[-1] == "[DONE]", payloads[-2:]
        assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "abort", payloads[-2]
    assert GRACEFUL_SHUTDOWN_TIMEOUT_S - 5 <= took < GRACEFUL_SHUTDOWN_TIMEOUT_S, took


def test_serve_shutdown_aborts_the_orphaned_streams_in_one_line(serve_url, tiny_llama):
    """`serve shutdown` kills Serve's proxy at once, cutting its clients' streams (Serve's doing); the
    replica's requests, orphaned, are aborted quietly: one line for them all, no traceback. Before, each
    failed with a ~40-line traceback, one a second."""
    from ray import serve

    deploy(tiny_llama)  # again: the test before deleted it
    threads, events = long_streams(serve_url, 3)
    serve.shutdown()
    for t in threads:
        t.join(30)
    assert all(payloads[-1].startswith("cut: ") for payloads in events), [p[-1] for p in events]
    log = replica_log()
    assert "Traceback" not in log and "Request failed" not in log, log[-3000:]
    said = [line for line in log.splitlines() if "whose client is gone" in line]
    # One line for the burst (a straggler past the report's 1 s window would get a line of its own).
    assert said and sum(int(re.search(r"aborted (\d+) stream", line)[1]) for line in said) == 3, said


def _check_serve_config(doc: dict) -> None:
    from ray.serve.schema import ServeDeploySchema

    from runtime.entrypoints.ray_serve import ShoalDeployment, build_app

    schema = ServeDeploySchema.parse_obj(doc)
    for app in schema.applications:
        module, attr = app.import_path.split(":")
        builder = getattr(importlib.import_module(module), attr)
        assert builder is build_app
        build_app(app.args)  # ServerArgs accepts every arg
        assert {d["name"] for d in doc["applications"][0]["deployments"]} == {ShoalDeployment.name}


def test_serve_config_validates():
    _check_serve_config(yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()))


def test_rayservice_and_cluster_manifests():
    svc = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    assert svc["apiVersion"] == "ray.io/v1" and svc["kind"] == "RayService"
    _check_serve_config(yaml.safe_load(svc["spec"]["serveConfigV2"]))
    import ray

    assert svc["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
    cluster = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    assert cluster["head_node_type"] in cluster["available_node_types"]
    assert any("ray start --head" in c for c in cluster["head_start_ray_commands"])
    shoal = next(e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "shoal")
    assert callable(shoal.load())  # the `shoal serve` the manifests run


def test_dockerfile_installs_shoal_gpu():
    lines = [ln.strip() for ln in (DEPLOY / "Dockerfile").read_text().splitlines()]
    base = next(ln for ln in lines if ln.startswith("FROM "))
    assert "cu" in base.split(":")[-1] or "gpu" in base  # a CUDA base image
    assert any(ln.startswith("RUN pip install") and '".[gpu]"' in ln for ln in lines)
    for ln in lines:  # every COPY source exists in the repo
        if ln.startswith("COPY "):
            for src in [p for p in ln.split()[1:-1] if not p.startswith("--")]:
                assert (ROOT / src).exists(), src
    assert "shoal" in next(ln for ln in lines if ln.startswith("CMD"))
    # The Ray image runs as `ray`, and setuptools writes build/ beside the sources: the WORKDIR must be the
    # installing user's (a WORKDIR Docker creates is root's; pip then fails with "could not create 'build'").
    install = next(i for i, ln in enumerate(lines) if '".[gpu]"' in ln)
    user = next((ln.split()[1] for ln in reversed(lines[:install]) if ln.startswith("USER ")), "ray")
    workdir = next(ln.split()[1] for ln in reversed(lines[:install]) if ln.startswith("WORKDIR "))
    assert user == "root" or any(f"chown {user}" in ln and workdir in ln for ln in lines[:install]), (user, workdir)
