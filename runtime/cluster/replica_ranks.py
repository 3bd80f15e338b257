"""ReplicaRanks: what SchedulerActor (TP rank 0) does on all of one replica's TP ranks at once — a weight load
(every rank checks the checkpoint, then every rank loads) and a sleep / wake_up (every rank releases or
restores its memory, then a wake_up captures the CUDA graphs on all of them together). A rank left out of
step with the others fails the replica (only a relaunch makes them one model again). A mixin of SchedulerActor,
kept apart so the actor stays about its requests; WeightSyncRanks does the same for a trainer's broadcast."""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.admin_messages import CUDA_GRAPH, AdminReply, SleepControl, WeightUpdate


class ReplicaRanks:
    """Uses the actor's rank (TP rank 0's TpRank), _followers (the other ranks' TpWorkerActors), group (the
    BroadcastWorker that fails the replica) and name."""

    rank: Any
    group: Any
    name: str
    _followers: list[Any]

    def _update_all_ranks(self, update: WeightUpdate) -> AdminReply:
        """On the scheduler thread, nothing running: the followers' loops wait for the next step meanwhile."""
        worker = self.rank.worker
        reply = worker.check_weights(update)
        errors = [reply.error] if reply.error else self._on_followers("check_weights", update)
        if errors:
            return AdminReply(error=errors[0])
        reply = worker.update_weights(update, checked=True)
        if reply.error is not None:  # rank 0 reloaded its old weights; the followers never started
            return reply
        errors = self._on_followers("update_weights", update, True)
        if errors:  # the ranks now hold different weights: only a relaunch makes them one model again
            self.group.fail(f"weight update of {self.name} failed on a TP rank after rank 0 loaded: {errors[0]}")
            return AdminReply(error=errors[0])
        return reply

    def _memory_all_ranks(self, ctl: SleepControl) -> AdminReply:
        """On the scheduler thread, nothing running; every rank at once. A wake_up first restores the memory
        of every rank, then (all succeeded, nothing left released) captures the CUDA graphs on all of them
        together: the capture runs the model, whose TP collectives need every rank in them."""
        if not self._followers:
            return self.rank.worker.memory_sleep(ctl)
        reply = self._on_all_ranks(msgspec.structs.replace(ctl, graphs=False) if not ctl.sleep else ctl)
        if reply.error is None and not ctl.sleep and not reply.sleeping_tags and ctl.graphs:
            graphs = self._on_all_ranks(SleepControl(sleep=False, tags=(CUDA_GRAPH,)))
            reply.error = graphs.error
        return reply

    def _on_all_ranks(self, ctl: SleepControl) -> AdminReply:
        import ray

        refs = [f.memory_sleep.remote(ctl) for f in self._followers]
        reply = self.rank.worker.memory_sleep(ctl)
        replies = [reply, *ray.get(refs)]
        errors = [r.error for r in replies if r.error]
        if errors and len(errors) < len(replies):  # the ranks now differ: only a relaunch makes them one again
            self.group.fail(f"{'sleep' if ctl.sleep else 'wake_up'} of {self.name} failed on some TP ranks only: "
                            f"{errors[0]}")
        reply.error = errors[0] if errors else None
        return reply

    def _on_followers(self, method: str, *args: Any) -> list[str]:
        """Calls `method` on every other TP rank and waits; their errors."""
        if not self._followers:
            return []
        import ray

        replies = ray.get([getattr(f, method).remote(*args) for f in self._followers])
        return [r.error for r in replies if r.error]
