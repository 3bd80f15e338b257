"""ReplicaHealth: RayEngineClient's view of its replicas' health (kept here: ray_engine_client.py is at its size
limit). A loop pings every routing target (SchedulerActor.health: a dead actor answers not at all, a failed TP
rank or a scheduler whose steps keep failing or met a dead device answers unhealthy) and refreshes the loads
least_load routes by; a failure routes around the replica and relaunches it (RayEngineClient._on_failure), and
the reason is kept until the relaunched replica serves. An unhealthy answer is left to the target's output pump,
which hears it (with the reason) in order with the outputs before it. health() (GET /health) is unhealthy only
while no replica can serve, with each down replica's reason: one replica down leaves the server healthy.

A relaunch retries with backoff until it serves; while its placement waits for the cluster to free (or a node to
bring back) what the replica needs, the reason says what it waits for (ReplicaLauncher.waiting)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from runtime.engine_client import EngineHealth
from runtime.errors import EngineUnavailableError

logger = logging.getLogger(__name__)

RELAUNCH_BACKOFF_S = (1.0, 30.0)  # the first retry's delay, doubled up to the second


class ReplicaHealth:
    """A mixin of RayEngineClient: it uses its replicas, groups, launcher, _restarting, _closing, _actor(),
    _targets_of(), _on_failure(), _start_pumps() and _restore_pause()."""

    replicas: list[Any]
    groups: list[Any]
    launcher: Any  # ReplicaLauncher
    restarts: int
    health_interval_s: float
    health_timeout_s: float
    _target_group: list[int]
    _restarting: set[int]
    _closing: bool

    def _init_health(self) -> None:
        self._down: dict[int, str] = {}  # replica group → why it went down, until its relaunch serves

    def health(self) -> EngineHealth:
        if self._closing or any(r.alive for r in self.replicas):
            return EngineHealth()
        down = dict(self._down)  # the client loop writes it
        why = "; ".join(m + self._relaunch_note(g) for g, m in sorted(down.items()))
        return EngineHealth(healthy=False, reason=f"no replica can serve: {why or 'every replica is down'}")

    def _relaunch_note(self, gi: int) -> str:
        if gi not in self._restarting:
            return ""
        waits = dict(self.launcher.waiting)  # the relaunch threads write it
        return f" (relaunching; waiting for resources: {waits[gi]})" if gi in waits else " (relaunching)"

    def _mark_down(self, gi: int, message: str) -> None:
        self._down[gi] = message

    def _mark_up(self, gi: int) -> None:
        self._down.pop(gi, None)

    def wait_until_healthy(self, timeout_s: float = 120.0) -> None:
        """Blocks until every replica is alive again (after a relaunch)."""
        deadline = time.monotonic() + timeout_s
        while not all(r.alive for r in self.replicas):
            if time.monotonic() > deadline:
                raise EngineUnavailableError(f"replicas still down after {timeout_s:.0f} s")
            time.sleep(0.1)

    async def _health_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.health_interval_s)
            for g in list(self.groups):
                if g.index in self._restarting:
                    continue
                for i in self._targets_of(g.index):
                    await self._check_target(i, g.generation)

    async def _check_target(self, i: int, generation: int) -> None:
        gi = self._target_group[i]
        try:  # liveness: the actor answers on its event loop even while a long step runs
            healthy = await asyncio.wait_for(self._actor(i).health.remote(), self.health_timeout_s)
        except Exception as e:
            if not self._closing:
                self._on_failure(gi, generation, self._failure_message(gi, e))
            return
        if not healthy:  # its pump hears the same from it, after the outputs before it (whose failure each is
            return  # decides whether it moves: RayEngineClient._pump); moving them from here could overtake those
        try:  # load: waits for the step in progress; a slow answer keeps the last known load
            stats = await asyncio.wait_for(self._actor(i).stats.remote(), self.health_timeout_s)
        except Exception:
            return
        self.replicas[i].load = stats.num_used_tokens + stats.waiting_tokens

    @staticmethod
    def _failure_message(gi: int, e: BaseException) -> str:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"replica {gi} is down: {type(e).__name__}" + (f": {first}" if first else "")

    async def _relaunch(self, gi: int) -> None:
        old = self.groups[gi]
        await asyncio.to_thread(old.kill)
        delay = RELAUNCH_BACKOFF_S[0]
        while not self._closing:
            try:
                new = await asyncio.to_thread(self.launcher.launch, gi, old.generation + 1)
                break
            except EngineUnavailableError as e:  # not placed (resources, a lost node): the launcher said why
                logger.warning("relaunch of replica %d failed: %s; retrying in %.0f s", gi, e, delay)
            except Exception:
                logger.exception("relaunch of replica %d failed; retrying in %.0f s", gi, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RELAUNCH_BACKOFF_S[1])
        else:
            return
        if self._closing:
            await asyncio.to_thread(new.kill)
            return
        self.groups[gi] = new
        self._restarting.discard(gi)
        self.restarts += 1
        for i in self._targets_of(gi):
            self.replicas[i].prefixes.reset()  # a fresh cache, and a fresh event log to read from -1
        await self._start_pumps(new)  # links first: a routed request is sent over its target's link
        await self._restore_pause(gi, new)  # paused as the others are, its LoRA adapters, then live (RayAdminClient)
        if self.groups[gi] is new and gi not in self._restarting:  # unless it failed again meanwhile
            self._mark_up(gi)
            for i in self._targets_of(gi):
                self.replicas[i].alive = True
            logger.info("replica %d is back (generation %d)", gi, new.generation)
