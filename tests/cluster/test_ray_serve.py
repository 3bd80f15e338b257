"""Ray Serve: the built app answers the openai client through Serve's HTTP proxy (plain and streaming),
and the deploy/ manifests are valid — serve_config.yaml and rayservice.yaml against Ray's own Serve
schema with an import_path that resolves, cluster.yaml and the Dockerfile pointing at real entry points."""

from __future__ import annotations

import importlib
import importlib.metadata
import socket
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_url(ray_session, tiny_llama):
    from ray import serve
    from ray_helpers import start_local_ray

    from runtime.entrypoints.ray_serve import build_app

    start_local_ray()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model_path": str(tiny_llama), "device": "cpu", "max_total_tokens": 1024}),
              name="shoal", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def test_serve_answers_openai_client(serve_url, tiny_llama):
    import openai
    import requests

    assert requests.get(serve_url + "/health", timeout=30).status_code == 200
    client = openai.OpenAI(base_url=serve_url + "/v1", api_key="none", max_retries=0, timeout=60)
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
