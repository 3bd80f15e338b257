"""GatewayActor: the aiohttp gateway hosted in a Ray actor over its own RayEngineClient answers the
OpenAI API, and /metrics reflects the replicas' summed scheduler stats."""

from __future__ import annotations

import pytest
from ray_helpers import wait_healthy

from runtime.config import ServerArgs

pytestmark = pytest.mark.ray


def test_gateway_actor_serves(ray_local, tiny_llama):
    import openai
    import ray
    import requests

    from runtime.cluster.launch import launch_gateway_actor

    args = ServerArgs(model_path=str(tiny_llama), use_ray=True, device="cpu", max_total_tokens=1024)
    gateway = launch_gateway_actor(args, port=0)
    try:
        url = ray.get(gateway.url.remote())
        assert ray.get(gateway.ready.remote())
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model=tiny_llama.name, prompt="Hello", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        metrics = requests.get(url + "/metrics", timeout=10).text
        assert "shoal" in metrics
    finally:
        ray.get(gateway.shutdown.remote())
        ray.kill(gateway)


def test_gateway_actor_that_cannot_start_says_why(ray_local, tmp_path):
    # Its constructor's ModelConfigError reaches the caller only as Ray's ActorDiedError text.
    from runtime.cluster.launch import launch_gateway_actor
    from runtime.errors import EngineUnavailableError

    args = ServerArgs(model_path=str(tmp_path / "missing"), use_ray=True, device="cpu", max_total_tokens=1024)
    with pytest.raises(EngineUnavailableError) as ei:
        launch_gateway_actor(args, port=0)
    assert str(ei.value).startswith("the gateway actor did not start: ModelConfigError: no config.json")
    assert "Traceback" not in str(ei.value)


def test_cli_serves_through_a_gateway_actor(ray_local, tiny_llama):
    """`shoal serve` on Ray (serve_gateway_actor): the gateway actor, pinned to this node, answers at
    --host:--port with cache-aware routing over DP=2 and admission on; stopping the CLI takes it down."""
    import socket
    import threading

    import requests

    from runtime.entrypoints.gateway_launcher import serve_gateway_actor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ServerArgs(model_path=str(tiny_llama), dp_size=2, device="cpu", max_total_tokens=1024, port=port)
    stop = threading.Event()
    runner = threading.Thread(target=serve_gateway_actor, args=(args, stop), daemon=True)
    runner.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120)
        body = {"prompt": "Hello there, how are you? " * 6, "max_tokens": 4, "temperature": 0}  # a few pages
        for _ in range(2):
            r = requests.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        metrics = requests.get(url + "/metrics", timeout=10).text
        assert 'shoal:cache_aware_routed_total{by="cache"} 1.0' in metrics  # the 2nd found the 1st's prefix
        assert "shoal:replica_inflight_requests" in metrics
    finally:
        stop.set()
        runner.join(timeout=90)
    assert not runner.is_alive()
