"""ReplicaGroup: the actors that live and die together — one replica's TP workers and its scheduler,
or, with DP attention, every DP rank (each rank a scheduler + worker; the MLP group spans them all)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from runtime.messages import WorkerInfo

logger = logging.getLogger(__name__)

STOP_WAIT_S = 2.0


@dataclass
class ReplicaGroup:
    index: int
    workers: list[Any]  # one actor per rank: rank 0 (and with DP attention every rank) a SchedulerActor
    schedulers: list[Any]  # the SchedulerActors among them: one per routing target
    info: WorkerInfo
    generation: int = 0  # bumped on every relaunch

    def kill(self) -> None:
        """Kills every rank. A started group's schedulers hear first that it is on purpose: the followers' deaths
        that they would otherwise see before their own (ray.kill is asynchronous) are then no failure to log."""
        import ray

        if self.info is not None and len(self.workers) > len(self.schedulers):
            stops = []
            for s in self.schedulers:
                try:
                    stops.append(s.stop.remote())
                except Exception:  # already dead
                    logger.debug("stop failed", exc_info=True)
            if stops:  # a hung one is killed all the same
                ray.wait(stops, num_returns=len(stops), timeout=STOP_WAIT_S)
        for actor in self.workers:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                logger.debug("ray.kill failed", exc_info=True)

    def node_ids(self) -> list[str]:
        """The node of each worker rank (tests and logs: where did placement put them)."""
        import ray

        return ray.get([w.node_id.remote() for w in self.workers])


def kill_all(groups: Sequence[ReplicaGroup]) -> None:
    """Kills every group at once (a shutdown): each waits up to STOP_WAIT_S for its schedulers' stop, all of them
    together, so the shutdown waits that once rather than once per replica."""
    if len(groups) <= 1:
        for group in groups:
            group.kill()
        return
    with ThreadPoolExecutor(len(groups), thread_name_prefix="shoal-kill") as pool:
        for done in [pool.submit(group.kill) for group in groups]:
            done.result()
