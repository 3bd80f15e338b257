"""create_ray_engine_client with no cluster running starts a local one — also from a short-lived thread
(the gateway loads the engine on one): Ray's GCS/raylet die with the thread that spawned them, so the
client must keep serving after that thread has ended — and shutting the client down stops that cluster."""

from __future__ import annotations

import threading

import pytest
from ray_helpers import greedy, run_all

from runtime.config import ServerArgs
from runtime.messages import GenerateRequest

pytestmark = pytest.mark.ray


def test_local_cluster_started_from_a_thread(tiny_llama):
    import ray

    from runtime.cluster.launch import create_ray_engine_client

    ray.shutdown()  # the shared session cluster, if running: this test starts its own
    box = {}
    loader = threading.Thread(target=lambda: box.setdefault("client", create_ray_engine_client(
        ServerArgs(model_path=str(tiny_llama), use_ray=True, device="cpu", max_total_tokens=1024))))
    loader.start()
    loader.join()
    client = box["client"]
    try:
        assert client.owns_ray and ray.is_initialized()
        results = run_all(client, [GenerateRequest(rid=f"t{i}", input_ids=[5, 6, 7 + i], sampling_params=greedy(5))
                                   for i in range(2)])
        assert [last.finish_reason.kind for _, last in results] == ["length", "length"]
        assert client.replica_stats_sync()[0].num_running_reqs == 0
    finally:
        client.shutdown()
    assert not ray.is_initialized()
