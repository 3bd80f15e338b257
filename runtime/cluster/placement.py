"""Placement: one Ray placement group per replica, one bundle per TP rank (or DP-attention rank).

--placement pack puts a replica's bundles on as few nodes as possible (NVLink within a node);
--placement spread puts them on different nodes where it can (a TP group across nodes). Extra custom
resources per replica (e.g. {"node:rack-a": 0.01}) pin replicas to nodes that advertise them."""

from __future__ import annotations

from typing import Any

from runtime.errors import EngineUnavailableError

STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}
PLACEMENT_TIMEOUT_S = 120.0


def bundle_resources(use_gpu: bool, extra: dict[str, float] | None = None) -> dict[str, float]:
    bundle: dict[str, float] = {"CPU": 1.0}
    if use_gpu:
        bundle["GPU"] = 1.0
    bundle.update(extra or {})
    return bundle


def create_placement_group(num_bundles: int, placement: str, use_gpu: bool, name: str,
                           extra: dict[str, float] | None = None,
                           timeout_s: float = PLACEMENT_TIMEOUT_S) -> Any:
    """Reserves the bundles, waiting until the cluster can hold them (EngineUnavailableError if not)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if placement not in STRATEGIES:
        raise ValueError(f"placement must be one of {', '.join(STRATEGIES)}, got {placement!r}")
    bundles = [bundle_resources(use_gpu, extra) for _ in range(num_bundles)]
    pg = placement_group(bundles, strategy=STRATEGIES[placement], name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise EngineUnavailableError(
            f"cannot place {name}: {num_bundles} x {bundles[0]} ({placement}) does not fit in the cluster's "
            f"free resources {ray.available_resources()} within {timeout_s:.0f} s")
    return pg


def bundle_strategy(pg: Any, bundle_index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle_index,
                                            placement_group_capture_child_tasks=True)


def remove(pg: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:  # already gone with the cluster
        pass
