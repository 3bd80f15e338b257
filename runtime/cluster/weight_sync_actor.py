"""WeightSyncRanks: one replica's TP ranks in a trainer's weight update group on the Ray path (SchedulerActor,
TP rank 0, calls it; the other ranks are TpWorkerActors), with the in-process Engine's rules
(EngineAdmin._sync_checked):

- init: every rank joins at once; if any fails, the ranks that joined leave again, so a retry is not told
  "already exists" by half of the replica.
- update: rank 0 must hold the group before any request is held; every rank receives and checks, then all
  load or all drop. An update refused before the receive ran (the weights asleep, the scheduler stopped)
  closes the group on every rank: a broadcast nobody reads hangs the trainer (nccl) or stays buffered for
  the next update to read (gloo).
- destroy: every rank at once."""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.admin_messages import AdminReply, DistributedWeights, WeightSyncInit, closed_group
from runtime.cluster.broadcast_worker import describe_exception
from runtime.errors import EngineUnavailableError, InvalidRequestError

JOIN, RECEIVE, LEAVE = "init_weights_update_group", "update_weights_from_distributed", "destroy_weights_update_group"
Result = AdminReply | Exception  # an exception: the rank's call raised, its state is unknown


class WeightSyncRanks:
    def __init__(self, actor: Any):  # SchedulerActor: its rank, _followers, host and group, read at each call
        self.actor = actor

    def call(self, method: str, arg: Any) -> AdminReply:
        if method == JOIN:
            return self.join(arg)
        if method == RECEIVE:
            return self.update(arg)
        return _combined(self._each(method, arg))

    def join(self, init: WeightSyncInit) -> AdminReply:
        results = self._each(JOIN, init)
        reply = _combined(results)
        joined = [i for i, r in enumerate(results) if not isinstance(r, AdminReply) or r.error is None]
        if reply.error is not None and joined:  # a rank refused: its error reply means it holds no new group
            self._each(LEAVE, init.group_name, joined)
            reply.error += f"; the TP ranks that had joined ({', '.join(map(str, joined))}) left the group again"
        return reply

    def update(self, update: DistributedWeights) -> AdminReply:
        if self.actor.rank.worker.sync_groups.get(update.group_name) is None:  # before any request is held
            return AdminReply(error=f"weight update group {update.group_name!r} does not exist: "
                                    "init_weights_update_group first")
        received: list[bool] = []

        def receive() -> AdminReply:
            received.append(True)
            return self._receive_all_ranks(update)

        try:
            reply = self.actor.host.update_weights(receive, update.abort_all_requests, update.flush_cache,
                                                   update.weight_version)
        except (InvalidRequestError, EngineUnavailableError) as e:  # the scheduler stopped or did not answer
            reply = AdminReply(error=str(e))
        if not received:  # refused first: nothing took the broadcast
            self._each(LEAVE, update.group_name)
            reply.error = closed_group(InvalidRequestError(reply.error or ""), update.group_name).message
        return reply

    def _receive_all_ranks(self, update: DistributedWeights) -> AdminReply:  # all load only if all ranks' fit
        reply = _combined(self._each("receive_weights", update))
        loaded = _combined(self._each("drop_received" if reply.error else "load_received", None))
        if not reply.error and loaded.error and self.actor._followers:  # ranks may differ: a relaunch makes them one
            self.actor.group.fail(f"weight update of {self.actor.name} failed on a TP rank: {loaded.error}")
        return reply if reply.error else loaded

    def _each(self, method: str, arg: Any, ranks: list[int] | None = None) -> list[Result]:
        """`method` on the TP ranks (all, or those listed; 0 is this one) at once; each rank's result."""
        import ray

        followers = self.actor._followers
        ranks = list(range(len(followers) + 1)) if ranks is None else ranks
        refs = {r: getattr(followers[r - 1], method).remote(arg) for r in ranks if r}  # first: rank 0 may wait
        results: dict[int, Result] = {}
        if 0 in ranks:
            try:
                results[0] = getattr(self.actor.rank.worker, method)(arg)
            except Exception as e:
                results[0] = e
        for r, ref in refs.items():
            try:
                results[r] = ray.get(ref)
            except Exception as e:  # the actor died, say
                results[r] = e
        return [results[r] for r in ranks]


def _combined(results: list[Result]) -> AdminReply:
    """The first rank's reply (its message) with the first error of any rank."""
    reply = next((r for r in results if isinstance(r, AdminReply)), None) or AdminReply()
    errors = [r.error if isinstance(r, AdminReply) else f"TP rank {i}: {describe_exception(r)}"
              for i, r in enumerate(results) if not isinstance(r, AdminReply) or r.error]
    return msgspec.structs.replace(reply, error=errors[0] if errors else None)  # a copy: results stay each rank's
