"""RayAdminClient: RayEngineClient's operator calls (kept here: ray_engine_client.py is at its size limit) —
a prefix-cache flush, or a profiler start / stop, sent as one typed actor call to every live routing target's
SchedulerActor (each replica, each DP rank), which runs it on its scheduler thread between two steps; a
profiler command reaches that replica's other TP ranks over its StepChannel (BroadcastWorker.profile). The
answers are summed into one AdminReply; a target that fails to answer counts as that target's error.

A weight update (SGLang's /update_weights_from_disk) goes to every routing target at once; each checks the
checkpoint on all its TP ranks before any copies (SchedulerActor.update_weights_from_disk). The files are
the same for all, so a check fails on all or none; a target whose load fails while others succeed is named
in the error (the replicas then serve different weights until the update is repeated).

A trainer's broadcast weights (SGLang's init_weights_update_group / update_weights_from_distributed /
destroy_weights_update_group) go to every routing target too: target i's TP rank r joins the trainer's group
as rank_offset + i * (TP ranks per target) + r, so world_size counts every TP rank of every target (SGLang's
rank_offset + tp_rank with one target); each target has all its ranks receive the broadcast at once
(SchedulerActor.weight_sync). A join refused by any target is undone on the targets that joined (a retry is
never told "already exists"). A relaunched replica is not in the group: init a new one.

Sleep / wake_up (SleepControl) go to every routing target the same way; each has all its TP ranks release or
restore their memory (SchedulerActor.memory_sleep). is_sleeping: any target has memory released. While the
last reply said something sleeps, validate() refuses a request at once (EngineAsleepError: the gateway's 503)
instead of it reaching a target that ends it with an error (a 500).

Pause / continue (SGLang's /pause_generation, /continue_generation) go to every routing target the same way;
each pauses its own scheduler (SchedulerActor.pause_generation); requests routed to a paused target wait there."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from runtime.admin_messages import (
    AdminReply,
    DistributedWeights,
    EngineAsleepError,
    PauseControl,
    ProfileControl,
    SleepControl,
    WeightSyncInit,
    WeightUpdate,
    closed_group,
    distributed_weights,
    weight_sync_init,
)
from runtime.errors import InvalidRequestError
from runtime.messages import GenerateRequest


class RayAdminClient:
    """A mixin of RayEngineClient: it uses its replicas and _actor()."""

    replicas: list[Any]
    args: Any  # ServerArgs
    launcher: Any  # ReplicaLauncher
    model_path: str | None

    async def flush_prefix_cache(self) -> AdminReply:
        return await self._admin_call("flush_cache", lambda i: ())

    async def profile(self, ctl: ProfileControl) -> AdminReply:
        # Each target writes its own ranks' files: the replica's index keeps their names apart.
        def args(i: int) -> tuple[ProfileControl]:
            return (msgspec.structs.replace(ctl, trace_id=f"{ctl.trace_id}-replica{i}") if ctl.start else ctl,)

        return await self._admin_call("profile", args)

    async def update_weights(self, update: WeightUpdate) -> AdminReply:
        reply = await self._admin_call("update_weights_from_disk", lambda i: (update,))
        if reply.error is None:
            self.model_path = update.model_path  # /get_model_info's model_path, as SGLang's
            if hasattr(self.launcher, "model_path"):  # a replica relaunched after a failure loads the new weights
                self.launcher.model_path = update.model_path
        return reply

    async def join_weight_sync(self, init: WeightSyncInit) -> AdminReply:
        weight_sync_init(init)
        ranks = 1 if self.args.enable_dp_attention else self.args.tp_size  # TP ranks per routing target
        down = [r.index for r in self.replicas if not r.alive]
        if down:
            return AdminReply(error=f"routing targets {down} are down: every TP rank of every target joins the group")
        if init.world_size < init.rank_offset + len(self.replicas) * ranks:
            return AdminReply(error=f"world_size {init.world_size} has no room for this server's "
                                    f"{len(self.replicas) * ranks} TP ranks from rank_offset {init.rank_offset}")
        results = await self._on_targets("weight_sync", lambda i: (
            "init_weights_update_group", msgspec.structs.replace(init, rank_offset=init.rank_offset + i * ranks)))
        reply = _combined(results)
        joined = [i for i, r in results if not isinstance(r, AdminReply) or r.error is None]
        if reply.error is not None and joined:  # a target refused (its ranks left again): so do the others
            await self._on_targets("weight_sync", lambda i: ("destroy_weights_update_group", init.group_name), joined)
            reply.error += f"; routing targets {joined} left the group again"
        return reply

    async def sync_weights(self, update: DistributedWeights) -> AdminReply:
        try:
            distributed_weights(update)
        except InvalidRequestError as e:  # the broadcast beside it cannot be received: close the group under it
            closed = (await self.leave_weight_sync(update.group_name)).error is None
            raise (closed_group(e, update.group_name) if closed else e) from None
        return await self._admin_call("weight_sync", lambda i: ("update_weights_from_distributed", update))

    async def leave_weight_sync(self, group_name: str) -> AdminReply:
        return await self._admin_call("weight_sync", lambda i: ("destroy_weights_update_group", group_name))

    _asleep: tuple[str, ...] = ()  # the tags the last sleep / wake_up reply said stay released

    async def memory_sleep(self, ctl: SleepControl) -> AdminReply:
        reply = await self._admin_call("memory_sleep", lambda i: (ctl,))
        self._asleep = tuple(reply.sleeping_tags)
        return reply

    def _awake(self, req: GenerateRequest) -> GenerateRequest:
        if self._asleep:
            raise EngineAsleepError(self._asleep)
        return req

    async def sleeping_tags(self) -> list[str]:
        targets = [r.index for r in self.replicas if r.alive]
        tags = await asyncio.gather(*(self._actor(i).sleeping_tags.remote() for i in targets), return_exceptions=True)
        return sorted({t for ts in tags if isinstance(ts, list) for t in ts})

    async def pause_steps(self, ctl: PauseControl) -> AdminReply:
        return await self._admin_call("pause_generation", lambda i: (ctl,))

    async def continue_steps(self) -> AdminReply:
        return await self._admin_call("continue_generation", lambda i: ())

    async def current_weight_version(self) -> str:
        """The targets' weight version ("a, b" while they differ: an update failed on some)."""
        targets = [r.index for r in self.replicas if r.alive]
        versions = await asyncio.gather(*(self._actor(i).weight_version.remote() for i in targets),
                                        return_exceptions=True)
        return ", ".join(dict.fromkeys(v for v in versions if isinstance(v, str))) or "default"

    async def _admin_call(self, method: str, args: Any) -> AdminReply:
        return _combined(await self._on_targets(method, args))

    async def _on_targets(self, method: str, args: Any, targets: list[int] | None = None) -> list[tuple[int, Any]]:
        """`method` on the live routing targets (or those listed) at once: (target, reply or exception) each."""
        targets = [r.index for r in self.replicas if r.alive] if targets is None else targets
        results = await asyncio.gather(*(getattr(self._actor(i), method).remote(*args(i)) for i in targets),
                                       return_exceptions=True)
        return list(zip(targets, results))


def _combined(results: list[tuple[int, Any]]) -> AdminReply:
    if not results:
        return AdminReply(error="no replica is serving")
    return AdminReply.combined([
        r if isinstance(r, AdminReply) else AdminReply(error=f"routing target {i}: {type(r).__name__}: {r}")
        for i, r in results])
