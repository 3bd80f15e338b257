"""Placement: one Ray placement group per replica, one bundle per TP rank (or DP-attention rank).

--placement pack puts a replica's bundles on as few nodes as possible (NVLink within a node);
--placement spread puts them on different nodes where it can (a TP group across nodes). Extra custom
resources per replica (e.g. {"node:rack-a": 0.01}) pin replicas to nodes that advertise them; a Serve
replica's accelerator_type is one ({"accelerator_type:L4": 0.001} in each bundle: accelerator_resource).

ReplicaPlacements keeps each replica's group across relaunches while it is whole. When a node dies, Ray
reschedules the group's lost bundles but keeps holding its surviving ones: two replicas spread over a lost node
would then each hold half of the node left and neither come back. So a relaunch replaces a group that lost
bundles, and a replica that cannot be placed holds nothing while it waits (a pending group reserves no bundle
until all of them fit)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from runtime.errors import EngineUnavailableError

logger = logging.getLogger(__name__)

STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}
PLACEMENT_TIMEOUT_S = 120.0
STATE_GRACE_S = 10.0  # how long a group's state may stay unreadable (a GCS hiccup) before its replica gives it up
WAIT_LOG_S = 15.0  # how often a placement that waits on busy resources says so
POLL_S = 1.0  # how soon a wait is reported (on_wait) and how often it checks for a shutdown
ACCELERATOR_PREFIX = "accelerator_type:"  # Ray's resource (1) on each node with that accelerator


def accelerator_resource(accelerator_type: str) -> dict[str, float]:
    """What pins a bundle to a node with that accelerator: 0.001 of Ray's resource, as Ray's own
    accelerator_type option and Ray Serve LLM's bundles ask for it (so any number of bundles share a node)."""
    return {ACCELERATOR_PREFIX + accelerator_type: 0.001}


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
    lacking = [k for k in sorted(need) if cluster.get(k, 0.0) + 1e-9 < need[k]]
    if not lacking:
        return None
    short = [f"{need[k]:g} {k} (the cluster has {cluster.get(k, 0.0):g})" for k in lacking]
    types = [k.removeprefix(ACCELERATOR_PREFIX) for k in lacking if k.startswith(ACCELERATOR_PREFIX)]
    fewer = "ask for fewer ranks (--tp-size, --dp-size)"
    hint = f"add nodes (`ray start --address <head>:6379`) or {fewer}"
    if types:  # no node has that accelerator (a Serve replica's accelerator_type): fewer ranks would not help
        hint = (f"add nodes with {' or '.join(types)} accelerators (`ray start --address <head>:6379` there) or "
                "give an accelerator_type the cluster has")
        hint += f", and add nodes or {fewer}" if len(types) < len(lacking) else ""
    return (f"the Ray cluster cannot hold {len(bundles)} rank(s) (one bundle of {bundles[0]} each): they need "
            f"{', '.join(short)}; {hint}")


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
                           extra: dict[str, float] | None = None, timeout_s: float | None = None,
                           on_wait: Callable[[str], None] | None = None,
                           stop: threading.Event | None = None) -> Any:
    """Reserves the bundles, waiting until the cluster can hold them (EngineUnavailableError if not).
    on_wait(what): told what the placement waits for, from a second in and then at every poll.
    stop: set by a shutdown, which gives the wait up (EngineUnavailableError) and reserves nothing."""
    from ray.util.placement_group import placement_group

    if placement not in STRATEGIES:
        raise ValueError(f"placement must be one of {', '.join(STRATEGIES)}, got {placement!r}")
    bundles = [bundle_resources(use_gpu, extra) for _ in range(num_bundles)]
    pg = placement_group(bundles, strategy=STRATEGIES[placement], name=name)
    try:
        wait_placed(pg, bundles, placement, name, PLACEMENT_TIMEOUT_S if timeout_s is None else timeout_s,
                    on_wait, stop)
    except BaseException:  # a shutdown, the timeout, or a failed query (the GCS): nobody else holds a handle to it
        remove(pg)
        raise
    return pg


def wait_placed(pg: Any, bundles: list[dict[str, float]], placement: str, name: str, timeout_s: float,
                on_wait: Callable[[str], None] | None, stop: threading.Event | None) -> None:
    """Waits until pg holds its bundles (create_placement_group's wait, which removes pg when this raises)."""
    import ray

    ready = pg.ready()  # once: each call schedules a task of its own
    # Other jobs may hold what we need, or nodes are still joining (check_capacity): wait, and say so.
    start = time.monotonic()
    deadline, next_log = start + timeout_s, start + POLL_S
    while not ray.wait([ready], timeout=min(POLL_S, max(deadline - time.monotonic(), 0.0)))[0]:
        now = time.monotonic()
        if stop is not None and stop.is_set():
            raise EngineUnavailableError(f"the placement of {name} was given up: shutting down")
        if now < start + POLL_S and now < deadline:  # placing takes a moment even when it fits
            continue
        # What the bundles need, 0 where none is free (Ray leaves a resource out once it is all taken).
        free = {k: ray.available_resources().get(k, 0.0) for k in bundles[0]}
        if on_wait is not None:  # every poll: the /health reason stays current
            on_wait(f"{len(bundles)} x {bundles[0]} ({placement}) for {name}, free now {free}")
        if now >= deadline:
            short = shortfall(bundles, ray.cluster_resources())
            raise EngineUnavailableError(
                f"cannot place {name} within {timeout_s:.0f} s: " + (short or (
                    f"{len(bundles)} x {bundles[0]} ({placement}) did not fit in the cluster's free resources "
                    f"{free} (other jobs hold the rest; `ray status` shows them)")))
        if now >= next_log:
            next_log = now + WAIT_LOG_S
            logger.warning("waiting for the Ray cluster to free %d x %s for %s (free now: %s)", len(bundles),
                           bundles[0], name, free)


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


def group_state(pg: Any) -> str:
    """Ray's word for the group: CREATED when whole; PENDING or RESCHEDULING while bundles wait (after a node
    loss Ray keeps holding the surviving ones); REMOVED. Raises what the query raises (the GCS did not answer)."""
    from ray.util.placement_group import placement_group_table

    return placement_group_table(pg).get("state", "REMOVED")


class ReplicaPlacements:
    """One placement group per replica (names[g], with extras[g] in every bundle): reserved at once, kept across
    relaunches while whole, replaced when it lost bundles, and released while its replica cannot be placed.
    waiting[g]: what replica g's placement waits for, while it does (the /health reason says so)."""

    def __init__(self, num_bundles: int, placement: str, use_gpu: bool, names: list[str],
                 extras: list[dict[str, float] | None]):
        self.num_bundles, self.placement, self.use_gpu = num_bundles, placement, use_gpu
        self.names, self.extras = names, extras
        self.waiting: dict[int, str] = {}
        self._pgs: list[Any | None] = [None] * len(names)
        self._unread_since: dict[int, float] = {}  # replica → when its group's state query began to fail
        self._lock = threading.Lock()  # relaunches acquire and release from their own threads
        self._stop = threading.Event()
        try:
            for g in range(len(names)):
                self.acquire(g)
        except BaseException:  # those already reserved would outlive the failed start
            self.shutdown()
            raise

    def acquire(self, g: int) -> Any:
        """Replica g's group, whole: the one it has, or a new one once the old one lost bundles (waits for
        resources as create_placement_group does)."""
        pg = self._pgs[g]
        if pg is not None:
            why = self.broken(g)
            if why is None:
                return pg
            logger.warning("replica %d cannot be placed in its group: %s; replacing it", g, why)
            self.release(g)
        pg = create_placement_group(self.num_bundles, self.placement, self.use_gpu, self.names[g], self.extras[g],
                                    on_wait=lambda what: self.waiting.__setitem__(g, what), stop=self._stop)
        with self._lock:
            if self._stop.is_set():  # shut down while it was being placed: nobody would free it
                remove(pg)
                raise EngineUnavailableError(f"the placement of {self.names[g]} was given up: shutting down")
            self._pgs[g] = pg
        self.waiting.pop(g, None)
        return pg

    def broken(self, g: int) -> str | None:
        """Why replica g's group cannot host its ranks now, None while it can."""
        pg = self._pgs[g]
        if pg is None:
            return f"its placement group {self.names[g]} was released"
        try:
            state = group_state(pg)
        except Exception as e:
            return self._unreadable(g, e)
        self._unread_since.pop(g, None)
        return None if state == "CREATED" else f"its placement group {self.names[g]} lost bundles (it is {state})"

    def _unreadable(self, g: int, e: Exception) -> str | None:
        """broken(g) while group g's state query fails: None (as if whole) for STATE_GRACE_S, since one failed query
        (a GCS hiccup) must not end a load in progress; why it is given up after that, or once Ray is shut down."""
        import ray

        since = self._unread_since.setdefault(g, time.monotonic())
        failing = time.monotonic() - since
        cause = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if not ray.is_initialized():
            return f"the state of its placement group {self.names[g]} cannot be read: Ray is shut down ({cause})"
        if failing >= STATE_GRACE_S:
            return (f"the state of its placement group {self.names[g]} cannot be read ({cause}; failing for "
                    f"{failing:.0f} s)")
        logger.debug("reading the state of placement group %s failed (%s): taken as whole for now", self.names[g],
                     cause)
        return None

    def release(self, g: int) -> None:
        """Frees replica g's group, so the bundles it still holds serve other replicas while it waits."""
        with self._lock:
            pg, self._pgs[g] = self._pgs[g], None
        self._unread_since.pop(g, None)  # its next group's state is its own
        if pg is not None:
            remove(pg)

    def shutdown(self) -> None:
        with self._lock:
            self._stop.set()
            pgs, self._pgs = self._pgs, [None] * len(self.names)
        for pg in pgs:
            if pg is not None:
                remove(pg)
