"""GatewayActor: the aiohttp gateway hosted in a Ray actor over its own RayEngineClient answers the
OpenAI API, and /metrics reflects the replicas' summed scheduler stats."""

from __future__ import annotations

import pytest

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
