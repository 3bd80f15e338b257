"""ReplicaHealth: RayEngineClient's view of its replicas' health (kept here: ray_engine_client.py is at its size
limit). A loop pings every routing target (SchedulerActor.health: a dead actor answers not at all, a failed TP
rank or a scheduler whose steps keep failing or met a dead device answers unhealthy) and refreshes the loads
least_load routes by; a failure routes around the replica and relaunches it (RayEngineClient._on_failure), and
the reason is kept until the relaunched replica serves. An unhealthy answer is left to the target's output pump,
which hears it (with the reason) in order with the outputs before it. health() (GET /health) is unhealthy only
while no replica can serve, with each down replica's reason: one replica down leaves the server healthy."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from runtime.engine_client import EngineHealth
from runtime.errors import EngineUnavailableError


class ReplicaHealth:
    """A mixin of RayEngineClient: it uses its replicas, groups, _restarting, _closing, _actor(), _targets_of()
    and _on_failure()."""

    replicas: list[Any]
    groups: list[Any]
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
        why = "; ".join(f"{m}{' (relaunching)' if g in self._restarting else ''}" for g, m in sorted(down.items()))
        return EngineHealth(healthy=False, reason=f"no replica can serve: {why or 'every replica is down'}")

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
