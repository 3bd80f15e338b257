"""A Serve replica's accelerator_type places all of its GPUs, as Ray Serve LLM's bundles do: with tp or dp > 1
(or use_ray) every bundle of every replica group's placement group asks for {"accelerator_type:<type>": 0.001},
so a heterogeneous cluster never puts a rank on another GPU type than its replica's. Before, only the Serve
replica actor was pinned and its TP/DP rank actors went to GPU nodes of any type. A cluster with no node of
that type fails with the shortfall naming the resource. Ray's placement calls are captured, not run."""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from runtime.cluster import launch, placement  # noqa: E402
from runtime.entrypoints import engine_factory  # noqa: E402
from runtime.entrypoints.ray_serve import build_app, replica_args  # noqa: E402
from runtime.entrypoints.serve_app_args import accelerator_split  # noqa: E402
from runtime.entrypoints.serve_lora import LoraLoading  # noqa: E402
from runtime.errors import EngineUnavailableError  # noqa: E402

CLUSTER = {"CPU": 64.0, "GPU": 8.0, "accelerator_type:L4": 1.0, "accelerator_type:H100": 1.0,
           "accelerator_type:A10G": 1.0}


@pytest.fixture
def bundles(monkeypatch) -> list[list[dict[str, float]]]:
    """Each placement group's bundles as ReplicaLauncher reserves them (placed at once), through the engine
    factory's path a Serve replica takes."""
    import ray

    groups: list[list[dict[str, float]]] = []
    ray_pg = importlib.import_module("ray.util.placement_group")  # ray.util's name is the function

    def placement_group(bundles: list[dict[str, float]], strategy: str, name: str) -> Any:
        groups.append(bundles)
        return SimpleNamespace(ready=lambda: "ready")

    monkeypatch.setattr(ray_pg, "placement_group", placement_group)
    monkeypatch.setattr(ray_pg, "remove_placement_group", lambda pg: None)
    monkeypatch.setattr(ray, "wait", lambda refs, timeout=None: (refs, []))
    monkeypatch.setattr(ray, "cluster_resources", lambda: CLUSTER)
    # The launcher alone (no actors): what create_ray_engine_client builds its groups with.
    monkeypatch.setattr(launch, "create_ray_engine_client", lambda args, replica_resources=None: launch.ReplicaLauncher(
        args, "m", replica_resources, cluster_fixed=True))
    return groups


def replica(config: dict[str, Any]) -> Any:
    """What a ShoalDeployment replica of build_app(config) starts its engine with."""
    server, loading = LoraLoading.split(build_app(config)._bound_deployment.init_args[0])
    server, accelerator = accelerator_split(server)
    return engine_factory.create_engine_client(replica_args({**server, "device": "cuda"}),
                                               accelerator_type=accelerator)


@pytest.mark.parametrize(("engine", "groups", "ranks"), [
    ({"tensor_parallel_size": 2}, 1, 2),
    ({"data_parallel_size": 2}, 2, 1),
    ({"tensor_parallel_size": 2, "data_parallel_size": 2}, 2, 2),
    ({"tensor_parallel_size": 2, "data_parallel_size": 2, "enable_dp_attention": True}, 1, 2),
])
def test_every_bundle_of_every_group_asks_for_the_accelerator(bundles, engine, groups, ranks):
    launcher = replica({"model_loading_config": {"model_id": "m", "model_source": "/m"}, "accelerator_type": "L4",
                        "engine_kwargs": engine})
    assert bundles == [[{"CPU": 1.0, "GPU": 1.0, "accelerator_type:L4": 0.001}] * ranks] * groups
    launcher.shutdown()


def test_flat_args_and_ray_actor_options_pin_the_ranks_too(bundles):
    replica({"model_path": "/m", "tp_size": 2, "accelerator_type": "H100"}).shutdown()
    replica({"model_loading_config": {"model_id": "m"}, "engine_kwargs": {"tensor_parallel_size": 2},
             "deployment_config": {"ray_actor_options": {"accelerator_type": "A10"}}}).shutdown()
    assert bundles[0] == [{"CPU": 1.0, "GPU": 1.0, "accelerator_type:H100": 0.001}] * 2
    assert bundles[1] == [{"CPU": 1.0, "GPU": 1.0, "accelerator_type:A10G": 0.001}] * 2  # Ray reads A10 as A10G


def test_no_accelerator_type_leaves_the_bundles_as_they_were(bundles):
    replica({"model_loading_config": {"model_id": "m"}, "engine_kwargs": {"tensor_parallel_size": 2,
                                                                          "data_parallel_size": 2}}).shutdown()
    assert bundles == [[{"CPU": 1.0, "GPU": 1.0}] * 2] * 2


def test_a_cluster_without_that_accelerator_fails_naming_it(bundles, monkeypatch):
    with pytest.raises(EngineUnavailableError, match=r"0\.004 accelerator_type:T4 \(the cluster has 0\); add "
                                                     r"nodes with T4 accelerators") as e:
        replica({"model_path": "/m", "tp_size": 2, "dp_size": 2, "accelerator_type": "T4"})
    assert "fewer ranks" not in str(e.value) and bundles == []  # nothing reserved
    # A cluster nodes may still join (Serve's): the placement waits for them, then fails in the same words.
    import ray

    monkeypatch.setattr(ray, "wait", lambda refs, timeout=None: ([], refs))
    monkeypatch.setattr(ray, "available_resources", lambda: CLUSTER)
    monkeypatch.setattr(placement, "POLL_S", 0.01)
    monkeypatch.setattr(placement, "PLACEMENT_TIMEOUT_S", 0.05)
    monkeypatch.setattr(launch, "create_ray_engine_client", lambda args, replica_resources=None: launch.ReplicaLauncher(
        args, "m", replica_resources, cluster_fixed=False))
    with pytest.raises(EngineUnavailableError, match=r"cannot place .* within 0 s: .*0\.002 accelerator_type:T4 "
                                                     r"\(the cluster has 0\); add nodes with T4"):
        replica({"model_path": "/m", "tp_size": 2, "accelerator_type": "T4"})
