"""Two Ray nodes on one machine (ray.cluster_utils.Cluster, one CPU slot and one custom resource each):
DP=2 puts one replica on each node when pinned by resource, and a TP=2 replica with --placement spread
spans both nodes (gloo across nodes) — both with the single-process Engine's greedy tokens."""

from __future__ import annotations

import pytest
from ray_helpers import greedy, run_all

from runtime.config import ServerArgs
from runtime.messages import GenerateRequest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = [[5, 6, 7, 8, 9], [70, 71, 72], [11, 12, 13, 14], [300, 301]]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the session's local cluster, if a module before us started it
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False,
        "object_store_memory": 128 << 20})
    cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=128 << 20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama):
    from runtime import Engine

    with Engine(str(tiny_llama), device="cpu", max_total_tokens=1024) as engine:
        return [engine.generate(input_ids=p, sampling_params={"max_new_tokens": 8, "temperature": 0})["output_ids"]
                for p in PROMPTS]


def run(client) -> list[list[int]]:
    return [ids for ids, _ in run_all(client, [GenerateRequest(rid=f"mn{i}", input_ids=p, sampling_params=greedy(8))
                                               for i, p in enumerate(PROMPTS)])]


def node_ids() -> dict[str, str]:
    import ray

    return {next(k for k in n["Resources"] if k.startswith("node_")): n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_one_replica_per_node(two_nodes, tiny_llama, expected):
    from runtime.cluster.launch import create_ray_engine_client

    client = create_ray_engine_client(
        ServerArgs(model_path=str(tiny_llama), dp_size=2, device="cpu", max_total_tokens=1024),
        replica_resources=[{"node_a": 0.01}, {"node_b": 0.01}])
    try:
        nodes = node_ids()
        assert [g.node_ids() for g in client.groups] == [[nodes["node_a"]], [nodes["node_b"]]]
        assert run(client) == expected
        assert all(s.cache_query_tokens > 0 for s in client.replica_stats_sync())  # both nodes served
    finally:
        client.shutdown()


def test_tp2_spread_across_nodes(two_nodes, tiny_llama, expected):
    from runtime.cluster.launch import create_ray_engine_client

    client = create_ray_engine_client(ServerArgs(model_path=str(tiny_llama), tp_size=2, placement="spread",
                                                 device="cpu", max_total_tokens=1024))
    try:
        assert sorted(client.groups[0].node_ids()) == sorted(node_ids().values())
        assert run(client) == expected
    finally:
        client.shutdown()


def test_too_few_cpus_fail_at_once_naming_what_is_missing(two_nodes, tiny_llama, monkeypatch, caplog):
    """Three replicas on a two-CPU cluster: on a cluster nothing will join (one Shoal started for itself), one
    line at once that says 3 CPU against 2; on a joined one (an autoscaler may add nodes for the pending
    placement) a warning naming the shortfall at once, then the placement's wait, ending in the same words
    (not Ray's per-group resource keys)."""
    import logging
    import time

    from runtime.cluster import placement
    from runtime.cluster.launch import create_ray_engine_client
    from runtime.errors import EngineUnavailableError

    args = ServerArgs(model_path=str(tiny_llama), dp_size=3, device="cpu", max_total_tokens=1024)
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError) as info:
        create_ray_engine_client(args, cluster_fixed=True)
    message = str(info.value)
    assert "3 CPU (the cluster has 2)" in message and "_group_" not in message, message
    assert time.monotonic() - start < 30  # no placement wait

    monkeypatch.setattr(placement, "PLACEMENT_TIMEOUT_S", 2.0)
    with caplog.at_level(logging.WARNING, logger="runtime.cluster.placement"), \
            pytest.raises(EngineUnavailableError) as info:
        create_ray_engine_client(args)  # joined (this test's cluster was not started by the call)
    assert "3 CPU (the cluster has 2)" in caplog.text and "waiting up to 2 s for nodes to join" in caplog.text
    assert "within 2 s" in str(info.value) and "_group_" not in str(info.value), info.value


def test_placement_helpers():
    from runtime.cluster import placement
    from runtime.errors import EngineUnavailableError

    raw = {"CPU": 2.0, "CPU_group_0_abc": 1.0, "GPU": 1.0, "node:10.0.0.1": 1.0, "memory": 1e9, "rack_a": 1.0}
    assert placement.plain_resources(raw) == {"CPU": 2.0, "GPU": 1.0, "rack_a": 1.0}
    bundles = [placement.bundle_resources(True, {"rack_a": 0.5})] * 2
    placement.check_capacity(bundles, raw | {"GPU": 2.0}, fixed=True)  # fits exactly: no error
    assert placement.shortfall(bundles, raw | {"GPU": 2.0}) is None
    with pytest.raises(EngineUnavailableError, match=r"2 GPU \(the cluster has 1\)") as info:
        placement.check_capacity(bundles, raw, fixed=True)
    assert "CPU (" not in str(info.value)  # only what is short is named
    placement.check_capacity(bundles, raw, fixed=False)  # a cluster that may grow: only a warning
