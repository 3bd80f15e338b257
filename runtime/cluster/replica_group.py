"""ReplicaGroup: the actors that live and die together — one replica's TP workers and its scheduler,
or, with DP attention, every DP rank (each rank a scheduler + worker; the MLP group spans them all)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from runtime.messages import WorkerInfo

logger = logging.getLogger(__name__)


@dataclass
class ReplicaGroup:
    index: int
    workers: list[Any]  # one actor per rank: rank 0 (and with DP attention every rank) a SchedulerActor
    schedulers: list[Any]  # the SchedulerActors among them: one per routing target
    info: WorkerInfo
    generation: int = 0  # bumped on every relaunch

    def kill(self) -> None:
        import ray

        for actor in self.workers:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                logger.debug("ray.kill failed", exc_info=True)

    def node_ids(self) -> list[str]:
        """The node of each worker rank (tests and logs: where did placement put them)."""
        import ray

        return ray.get([w.node_id.remote() for w in self.workers])
