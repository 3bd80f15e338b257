"""Placement: one Ray placement group per replica, one bundle per TP rank (or DP-attention rank).

--placement pack puts a replica's bundles on as few nodes as possible (NVLink within a node);
--placement spread puts them on different nodes where it can (a TP group across nodes). Extra custom
resources per replica (e.g. {"node:rack-a": 0.01}) pin replicas to nodes that advertise them."""

from __future__ import annotations

import logging
import time
from typing import Any

from runtime.errors import EngineUnavailableError

logger = logging.getLogger(__name__)

STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}
PLACEMENT_TIMEOUT_S = 120.0
WAIT_LOG_S = 15.0  # how often a placement that waits on busy resources says so


def bundle_resources(use_gpu: bool, extra: dict[str, float] | None = None) -> dict[str, float]:
    bundle: dict[str, float] = {"CPU": 1.0}
    if use_gpu:
        bundle["GPU"] = 1.0
    bundle.update(extra or {})
    return bundle


def plain_resources(resources: dict[str, float]) -> dict[str, float]:
    """Resources as an operator names them: without Ray's per-placement-group keys (CPU_group_<id>...),
    per-node keys (node:<ip>) and byte counts."""
    return {k: v for k, v in sorted(resources.items())
            if "_group_" not in k and not k.startswith("node:") and k not in ("memory", "object_store_memory")}


def shortfall(bundles: list[dict[str, float]], cluster: dict[str, float]) -> str | None:
    """What the cluster's total resources (free or not) lack to hold the bundles, in words; None if
    nothing. Sums per resource, so the message names what to add."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + amount
    short = [f"{need[k]:g} {k} (the cluster has {cluster.get(k, 0.0):g})" for k in sorted(need)
             if cluster.get(k, 0.0) + 1e-9 < need[k]]
    if not short:
        return None
    return (f"the Ray cluster cannot hold {len(bundles)} rank(s) (one bundle of {bundles[0]} each): they need "
            f"{', '.join(short)}; add nodes (`ray start --address <head>:6379`) or ask for fewer ranks "
            f"(--tp-size, --dp-size)")


def check_capacity(bundles: list[dict[str, float]], cluster: dict[str, float], fixed: bool) -> None:
    """fixed: nothing will join this cluster (one Shoal started for itself), so a shortfall fails at once.
    Otherwise nodes may still join (an autoscaler scales up for a pending placement group, `ray start`
    workers come up late): say so now and let the placement wait."""
    why = shortfall(bundles, cluster)
    if why is None:
        return
    if fixed:
        raise EngineUnavailableError(why)
    logger.warning("%s; waiting up to %.0f s for nodes to join (an autoscaler, late workers)", why,
                   PLACEMENT_TIMEOUT_S)


def create_placement_group(num_bundles: int, placement: str, use_gpu: bool, name: str,
                           extra: dict[str, float] | None = None, timeout_s: float | None = None) -> Any:
    """Reserves the bundles, waiting until the cluster can hold them (EngineUnavailableError if not)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if placement not in STRATEGIES:
        raise ValueError(f"placement must be one of {', '.join(STRATEGIES)}, got {placement!r}")
    bundles = [bundle_resources(use_gpu, extra) for _ in range(num_bundles)]
    pg = placement_group(bundles, strategy=STRATEGIES[placement], name=name)
    # Other jobs may hold what we need, or nodes are still joining (check_capacity): wait, and say so.
    timeout_s = PLACEMENT_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while not ray.wait([pg.ready()], timeout=min(WAIT_LOG_S, max(deadline - time.monotonic(), 0.0)))[0]:
        free = plain_resources(ray.available_resources())
        if time.monotonic() >= deadline:
            remove_placement_group(pg)
            short = shortfall(bundles, ray.cluster_resources())
            raise EngineUnavailableError(
                f"cannot place {name} within {timeout_s:.0f} s: " + (short or (
                    f"{num_bundles} x {bundles[0]} ({placement}) did not fit in the cluster's free resources "
                    f"{free} (other jobs hold the rest; `ray status` shows them)")))
        logger.warning("waiting for the Ray cluster to free %d x %s for %s (free now: %s)", num_bundles,
                       bundles[0], name, free)
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
