"""Ray Serve: the built app answers the openai client through Serve's HTTP proxy (plain and streaming), keyed
by $VLLM_API_KEY from the replica's runtime_env as `shoal serve` is by it (a keyless request is a 401), with
Date, Server and X-Request-Id once each (Serve's; the gateway's came too), LoRA adapters of
dynamic_lora_loading_path loaded on the replica a request reaches (the admin routes refused, as the app may
autoscale to two replicas), stopping it drains (`serve.delete`: streams end with finish_reason "abort" within graceful_shutdown_timeout_s;
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
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
GRACEFUL_SHUTDOWN_TIMEOUT_S = 8.0  # the tests' budget: streams in flight may run 3 s of it, then are aborted
API_KEY = "serve-test-key"  # the replica's $VLLM_API_KEY: every request below but /health sends it
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [5, 9, 13, 40, 22, 7, 31, 18, 44, 3, 27, 11]  # token ids: the LoRA answer is checked against HF's
N = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deploy(tiny_llama: Path, loras: Path) -> None:
    from ray import serve

    from runtime.entrypoints.ray_serve import ShoalDeployment

    # KV for three 50,000-token streams at once: the admission's wait estimate never queues long_streams' (it
    # would refuse one with a 429 once the tests before have measured the decode rate).
    args = {"model_path": str(tiny_llama), "device": "cpu", "max_total_tokens": 160000, "context_length": 60000,
            "dynamic_lora_loading_path": str(loras), "max_lora_rank": 8}
    keyed = {"runtime_env": {"env_vars": {"VLLM_API_KEY": API_KEY}}}  # as a serve_config.yaml's runtime_env sets it
    # May scale to 2 replicas (so the LoRA admin routes are refused), but never does here: one runs.
    scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1000, "upscale_delay_s": 3600}
    serve.run(ShoalDeployment.options(graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_TIMEOUT_S, ray_actor_options=keyed,
                                      autoscaling_config=scaling).bind(args),
              name="shoal", route_prefix="/")


@pytest.fixture(scope="module")
def loras(tiny_llama, tmp_path_factory) -> Path:
    """The loading path: `ad` (served on demand), `bad` (its rank is over max_lora_rank 8)."""
    sys.path.insert(0, str(ROOT / "tests" / "lora"))
    from lora_files import write_adapter

    root = tmp_path_factory.mktemp("serve_loras")
    write_adapter(root / "ad", tiny_llama, 21, ("q_proj", "v_proj", "down_proj"))
    write_adapter(root / "bad", tiny_llama, 22, ("q_proj",), r=16)
    return root


@pytest.fixture(scope="module")
def serve_url(ray_session, tiny_llama, loras):
    from ray import serve
    from ray_helpers import start_local_ray

    start_local_ray()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy(tiny_llama, loras)
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


def test_date_server_and_request_id_come_once(serve_url):
    """Serve's server writes Date, Server and X-Request-Id itself: the gateway's are not relayed too (a client
    read "abc2, abc2"). The one X-Request-Id names the response, whether the client sent it or Serve made it."""
    import requests

    body = {"prompt": "Hi", "max_tokens": 2}
    for sent, stream in (({"X-Request-Id": "abc2"}, False), ({}, False), ({"X-Request-Id": "abc3"}, True)):
        r = requests.post(serve_url + "/v1/completions", json={**body, "stream": stream}, headers={**AUTH, **sent},
                          timeout=60)
        assert r.status_code == 200
        for name in ("date", "server", "x-request-id"):
            assert len(r.raw.headers.getlist(name)) == 1, (name, r.raw.headers.getlist(name))
        rid = r.headers["x-request-id"]
        assert rid == sent.get("X-Request-Id", rid)
        first = r.json() if not stream else json.loads(r.text.split("\n")[0][len("data: "):])
        assert first["id"] == f"cmpl-{rid}"


def test_lora_adapters_load_on_demand_on_the_replica(serve_url, tiny_llama, loras):
    """A request naming an adapter of dynamic_lora_loading_path loads it on the replica it reaches (three at
    once: one load), by its id or Ray's `<base>:<id>`, and it answers as HF does with the adapter merged;
    /v1/models lists it before; one that does not load is a 400 naming it. The admin routes, which would load
    on one replica of a deployment that may have two, are refused saying what to do instead."""
    import requests
    from lora_files import hf_greedy, hf_merged
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(tiny_llama).decode(
        hf_greedy(hf_merged(tiny_llama, loras / "ad"), PROMPT, N))
    cards = {c["id"]: c for c in requests.get(serve_url + "/v1/models", headers=AUTH, timeout=30).json()["data"]}
    assert cards["ad"]["parent"] == tiny_llama.name and cards["ad"]["root"] == str(loras / "ad")

    def complete(model: str) -> requests.Response:
        return requests.post(serve_url + "/v1/completions", headers=AUTH, timeout=60, json={
            "model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True})

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(complete, ["ad"] * 3))
    assert [(r.status_code, r.json()["model"]) for r in answers] == [(200, "ad")] * 3
    assert all(r.json()["choices"][0]["text"] == expected for r in answers)
    assert replica_log().count("loaded the LoRA adapter 'ad'") == 1
    r = complete(f"{tiny_llama.name}:ad")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
    r = complete("bad")
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "did not load" in r.json()["error"]["message"] and "max-lora-rank" in r.json()["error"]["message"]
    assert complete("nope").json()["error"]["code"] == "model_not_found"

    load = {"lora_name": "x", "lora_path": str(loras / "ad")}
    r = requests.post(serve_url + "/v1/load_lora_adapter", json=load, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "autoscaling up to 2 replicas" in r.json()["error"]["message"], r.text
    assert requests.post(serve_url + "/v1/load_lora_adapter", json=load, timeout=30).status_code == 401


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


def test_serve_shutdown_aborts_the_orphaned_streams_in_one_line(serve_url, tiny_llama, loras):
    """`serve shutdown` kills Serve's proxy at once, cutting its clients' streams (Serve's doing); the
    replica's requests, orphaned, are aborted quietly: one line for them all, no traceback. Before, each
    failed with a ~40-line traceback, one a second."""
    from ray import serve

    deploy(tiny_llama, loras)  # again: the test before deleted it
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
    serve_config = yaml.safe_load(svc["spec"]["serveConfigV2"])
    _check_serve_config(serve_config)
    # Every pod outlives a stopping replica's drain: Kubernetes' SIGKILL would cut it (its default is 30 s).
    drain_s = max(d["graceful_shutdown_timeout_s"] for a in serve_config["applications"] for d in a["deployments"])
    cluster_config = svc["spec"]["rayClusterConfig"]
    pods = [cluster_config["headGroupSpec"], *cluster_config["workerGroupSpecs"]]
    assert all(p["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s for p in pods)
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
