"""RayAdminClient: RayEngineClient's operator calls (kept here: ray_engine_client.py is at its size limit) —
a prefix-cache flush, or a profiler start / stop, sent as one typed actor call to every live routing target's
SchedulerActor (each replica, each DP rank), which runs it on its scheduler thread between two steps; a
profiler command reaches that replica's other TP ranks over its StepChannel (BroadcastWorker.profile). The
answers are summed into one AdminReply; a target that fails to answer counts as that target's error.

A weight update (SGLang's /update_weights_from_disk) first asks every routing target whether it would take
it now (UpdateProbe: one holding a request paused in place refuses a flushing update, as do asleep weights);
one refusal refuses it on all, before any loads, naming each target that refused and why. Then it goes to
every target at once; each checks the checkpoint on all its TP ranks before any copies
(SchedulerActor.update_weights_from_disk). The files are the same for all, so a check fails on all or none; a
target whose load fails while others succeed is named in the error (the replicas then serve different
weights until the update is repeated).

A trainer's broadcast weights (SGLang's init_weights_update_group / update_weights_from_distributed /
destroy_weights_update_group) go to every routing target too: target i's TP rank r joins the trainer's group
as rank_offset + i * (TP ranks per target) + r, so world_size counts every TP rank of every target (SGLang's
rank_offset + tp_rank with one target); each target has all its ranks receive the broadcast at once
(SchedulerActor.weight_sync), after the same UpdateProbe (a refusal closes the group on every target: the
broadcast beside it has nobody to receive it). A join refused by any target is undone on the targets that
joined (a retry is never told "already exists"). A relaunched replica is not in the group: init a new one.

Sleep / wake_up (SleepControl) go to every routing target the same way; each has all its TP ranks release or
restore their memory (SchedulerActor.memory_sleep). is_sleeping: any target has memory released. While the
last reply said something sleeps, validate() refuses a request at once (EngineAsleepError: the gateway's 503)
instead of it reaching a target that ends it with an error (a 500).

Pause / continue (SGLang's /pause_generation, /continue_generation) go to every routing target the same way;
each pauses its own scheduler (SchedulerActor.pause_generation); requests routed to a paused target wait there.
The client keeps the mode it last sent: a replica relaunched meanwhile is paused in it before it takes requests
(_restore_pause), so it never steps while the others are paused."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from runtime.admin_messages import (
    AdminReply,
    DistributedWeights,
    EngineAsleepError,
    PauseControl,
    ProfileControl,
    SleepControl,
    UpdateProbe,
    WeightSyncInit,
    WeightUpdate,
    closed_group,
    distributed_weights,
    weight_sync_init,
)
from runtime.errors import InvalidRequestError
from runtime.messages import GenerateRequest

logger = logging.getLogger(__name__)


class RayAdminClient:
    """A mixin of RayEngineClient: it uses its replicas and _actor()."""

    replicas: list[Any]
    groups: list[Any]  # ReplicaGroup
    args: Any  # ServerArgs
    launcher: Any  # ReplicaLauncher
    model_path: str | None
    _restarting: set[int]
    # The pause mode last sent to the targets (None: continued) and a count of pauses and continues sent:
    # plain values, each replaced whole, read by a relaunch on the client's loop (_restore_pause).
    _pause_mode: str | None = None
    _pause_seq = 0

    async def flush_prefix_cache(self) -> AdminReply:
        return await self._admin_call("flush_cache", lambda i: ())

    async def profile(self, ctl: ProfileControl) -> AdminReply:
        # Each target writes its own ranks' files: the replica's index keeps their names apart.
        def args(i: int) -> tuple[ProfileControl]:
            return (msgspec.structs.replace(ctl, trace_id=f"{ctl.trace_id}-replica{i}") if ctl.start else ctl,)

        return await self._admin_call("profile", args)

    async def update_weights(self, update: WeightUpdate) -> AdminReply:
        refused = await self._refusals(UpdateProbe.of(update))
        if refused is not None:
            return AdminReply(error=refused)
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
        refused = await self._refusals(UpdateProbe.of(update))
        if refused is not None:  # nobody receives the broadcast beside it: close the group under it, as above
            closed = (await self.leave_weight_sync(update.group_name)).error is None
            return AdminReply(error=closed_group(InvalidRequestError(refused), update.group_name).message
                              if closed else refused)
        return await self._admin_call("weight_sync", lambda i: ("update_weights_from_distributed", update))

    async def _refusals(self, probe: UpdateProbe) -> str | None:
        """Every live target asked first whether it would take the update: the refusals, naming each target,
        or None. A target that cannot answer (its actor died) is left to the load, which names it too.
        The load checks again on each target (SchedulerHost._apply_update), and only there can a refusal
        come late: a paused target's answer cannot change by itself (no step runs, so no request gains KV),
        only by the operator's own pause in place or sleep sent while this update runs, and then that target
        alone refuses (named in the error) rather than flush KV it cannot drop; repeating the update fixes it."""
        results = await self._on_targets("check_update", lambda i: (probe,))
        refusals = [f"{self._target_name(i)}: {r.error}" for i, r in results if isinstance(r, AdminReply) and r.error]
        if not refusals:
            return None
        return "weight update refused on every replica, none loaded it; " + "; ".join(refusals)

    def _target_name(self, i: int) -> str:
        return f"DP rank {i}" if self.args.enable_dp_attention else f"replica {i}"

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
        return await self._pause_call(ctl.mode, "pause_generation", lambda i: (ctl,))

    async def continue_steps(self) -> AdminReply:
        return await self._pause_call(None, "continue_generation", lambda i: ())

    async def _pause_call(self, mode: str | None, method: str, args: Any) -> AdminReply:
        # Recorded before the live targets are listed (in _on_targets): a relaunch that finds the count
        # unchanged after marking its targets live was listed here (_restore_pause).
        before = self._pause_mode
        self._pause_mode, self._pause_seq = mode, self._pause_seq + 1
        results = await self._on_targets(method, args)
        if all(not isinstance(r, AdminReply) or r.error for _, r in results):  # none live, or all refused
            self._pause_mode, self._pause_seq = before, self._pause_seq + 1  # nothing changed: as it was
        return _combined(results)

    async def _restore_pause(self, gi: int, group: Any) -> None:
        """After replica group gi was relaunched as `group`, before it takes requests: its targets pause in the
        mode last sent (nothing to do if none is), then _restore_loras loads its adapters and routes to it. A
        pause or continue sent meanwhile skipped it (not live yet): seen by the count, it is sent again here
        (the count is compared after the targets went live, and a pause lists the live ones after counting)."""
        targets, sent, live = self._targets_of(gi), None, False
        while self.groups[gi] is group and gi not in self._restarting:  # unless it failed again meanwhile
            seq, mode = self._pause_seq, self._pause_mode
            if mode is not None or sent is not None:
                await self._pause_relaunched(targets, mode)
                sent = mode
            if not live and self.groups[gi] is group and gi not in self._restarting:
                await self._restore_loras(gi)
                live = True
            if self._pause_seq == seq:
                return

    async def _pause_relaunched(self, targets: list[int], mode: str | None) -> None:
        ctl = PauseControl(mode=mode) if mode is not None else None
        results = await self._on_targets("pause_generation" if ctl else "continue_generation",
                                         lambda i: (ctl,) if ctl else (), targets)
        for i, r in results:  # it serves anyway: a target that cannot pause (DP attention) never could
            if not isinstance(r, AdminReply) or r.error:
                logger.warning("relaunched %s: %s failed: %s", self._target_name(i),
                               f"pause ({mode})" if ctl else "continue",
                               r.error if isinstance(r, AdminReply) else f"{type(r).__name__}: {r}")

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
        results = await asyncio.gather(*(self._on_target(i, method, args(i)) for i in targets), return_exceptions=True)
        return list(zip(targets, results))

    async def _on_target(self, i: int, method: str, args: tuple) -> Any:
        return await getattr(self._actor(i), method).remote(*args)  # a handle that fails at once: i's error too


def _combined(results: list[tuple[int, Any]]) -> AdminReply:
    if not results:
        return AdminReply(error="no replica is serving")
    return AdminReply.combined([
        r if isinstance(r, AdminReply) else AdminReply(error=f"routing target {i}: {type(r).__name__}: {r}")
        for i, r in results])
