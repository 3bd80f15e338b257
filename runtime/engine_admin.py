"""EngineAdmin: the in-process Engine's operator calls (kept here: engine.py is at its size limit) — SGLang's
Engine.flush_cache and vLLM's LLM.reset_prefix_cache, Engine.start_profile / stop_profile (SGLang's and
vLLM's names), and the EngineClient side the gateway's /flush_cache, /reset_prefix_cache, /start_profile and
/stop_profile call. Each runs on the scheduler thread between two steps (SchedulerHost.call).

Live weight updates, SGLang's Engine.update_weights_from_disk / update_weights_from_tensor (and the gateway's
/update_weights_from_disk): SchedulerHost.update_weights holds new requests, lets the running ones finish
(or aborts them), loads between two steps (runtime/model_executor/weight_updater.py), flushes the prefix
cache. SGLang's return shapes: (success, message, num_paused_requests) and (success, message). The same
for update_weights_from_distributed, whose tensors a trainer broadcasts over a process group joined with
init_weights_update_group (SGLang's; runtime/model_executor/weight_sync_group.py).

Sleep mode for RL trainers sharing the GPUs: vLLM's LLM.sleep(level) / wake_up(tags) and SGLang's
Engine.release_memory_occupation(tags) / resume_memory_occupation(tags), and the EngineClient side of the
gateway's /sleep, /wake_up, /is_sleeping and /release_memory_occupation, /resume_memory_occupation
(runtime/model_executor/memory_sleep.py says what is released; SchedulerHost.memory_sleep how requests fare).
Errors are InvalidRequestError naming the problem (requests running, not enough memory to wake up).

Pause, for RL trainers around a weight sync: SGLang's Engine-side pause_generation(mode) / continue_generation()
and the EngineClient side of the gateway's /pause_generation and /continue_generation (SchedulerHost.pause_
generation says what abort, retract and in_place do; weight updates run while paused)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from runtime.admin_messages import (
    SYNC_GROUP,
    AdminReply,
    DistributedWeights,
    PauseControl,
    ProfileControl,
    SleepControl,
    WeightSyncInit,
    WeightUpdate,
    closed_group,
    distributed_weights,
    pause_control,
    profile_control,
    sleep_control,
    weight_sync_init,
)
from runtime.errors import EngineUnavailableError, InvalidRequestError, ShoalError


class EngineAdmin:
    host: Any  # SchedulerHost (Engine sets it)
    args: Any  # ServerArgs
    worker: Any  # TpWorker
    model_path: str

    def flush_cache(self) -> AdminReply:
        """Drops every prefix-cache entry no request uses now (their KV slots are freed); running requests keep
        theirs, so this is safe at any time. flushed_tokens / kept_tokens say how much went and stayed."""
        return self.host.flush_cache()

    def reset_prefix_cache(self) -> bool:
        """vLLM's LLM.reset_prefix_cache: flush_cache(); True (what running requests use stays, as above)."""
        return self.flush_cache().error is None

    def start_profile(self, num_steps: int | None = None, activities: list[str] | None = None,
                      with_stack: bool = False, record_shapes: bool = False) -> None:
        """Starts a torch.profiler trace of the worker's steps into --profile-dir (or $SHOAL_TORCH_PROFILER_DIR);
        num_steps: it stops by itself after that many steps. InvalidRequestError: no folder set, a bad
        num_steps or activity, a trace already running."""
        _check(self.host.profile(profile_control(self.args, num_steps, activities, with_stack, record_shapes)))

    def stop_profile(self) -> list[str]:
        """Stops the trace; the files rank 0 wrote (InvalidRequestError if none runs)."""
        return _check(self.host.profile(ProfileControl(start=False))).trace_files

    # ---- live weight updates ------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False, weight_version: str | None = None,
                                 flush_cache: bool = True) -> tuple[bool, str, int]:
        """Loads a checkpoint of the same architecture and shapes into the live weights (SGLang's signature and
        answer: success, message, num_paused_requests). On failure the old weights keep serving and the
        message names the problem."""
        reply = self._update_from_disk(WeightUpdate(model_path=str(model_path), load_format=load_format,
                                                    abort_all_requests=bool(abort_all_requests),
                                                    weight_version=weight_version, flush_cache=bool(flush_cache)))
        return reply.error is None, reply.error or reply.message, reply.num_paused_requests

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]], load_format: str | None = None,
                                   flush_cache: bool = True, abort_all_requests: bool = False,
                                   weight_version: str | None = None) -> tuple[bool, str]:
        """HF-named tensors (any subset of the checkpoint's) into the live weights through the model's own
        weight loaders (fused and TP-sharded parameters land right); SGLang's (success, message)."""
        if load_format not in (None, "direct"):
            return False, f"load_format {load_format!r} is not supported for tensors: pass None (or 'direct')"
        reply = self._update(lambda: self.worker.update_weights_from_tensor(list(named_tensors)),
                             abort_all_requests, flush_cache, weight_version)
        return reply.error is None, reply.error or reply.message

    # ---- weights broadcast by a trainer (runtime/model_executor/weight_sync_group.py) -----------------
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = SYNC_GROUP, backend: str = "nccl",
                                  timeout_s: float = 1800.0) -> tuple[bool, str]:
        """SGLang's: joins the trainer's process group (the trainer is rank 0, this engine rank_offset) and
        returns once every member has; the trainer calls its side at the same time. (success, message)."""
        return _pair(self._join(WeightSyncInit(
            master_address=str(master_address), master_port=int(master_port), rank_offset=int(rank_offset),
            world_size=int(world_size), group_name=str(group_name), backend=str(backend), timeout_s=float(timeout_s))))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[list[int]],
                                        group_name: str = SYNC_GROUP, flush_cache: bool = True,
                                        abort_all_requests: bool = False, weight_version: str | None = None,
                                        load_format: str | None = None) -> tuple[bool, str]:
        """SGLang's: receives the tensors the trainer broadcasts from rank 0 (in this order) and loads them as
        update_weights_from_tensor does (requests wait meanwhile; a name or shape that does not fit leaves the
        old weights serving, the broadcast consumed). A request refused before receiving (lists of different
        lengths, an unknown dtype) closes the group: the trainer's broadcast errors instead of hanging."""
        update = DistributedWeights(
            names=[str(n) for n in names], dtypes=[str(d).removeprefix("torch.") for d in dtypes],
            shapes=[list(s) if isinstance(s, (list, tuple)) else s for s in shapes], group_name=str(group_name), flush_cache=bool(flush_cache),
            abort_all_requests=bool(abort_all_requests), weight_version=weight_version, load_format=load_format)
        return _pair(self._sync(update))

    def destroy_weights_update_group(self, group_name: str = SYNC_GROUP) -> tuple[bool, str]:
        return _pair(self.worker.destroy_weights_update_group(str(group_name)))

    async def join_weight_sync(self, init: WeightSyncInit) -> AdminReply:
        weight_sync_init(init)  # InvalidRequestError (a 400) before waiting for anyone
        return await asyncio.to_thread(self.worker.init_weights_update_group, init)  # waits for the trainer

    async def sync_weights(self, update: DistributedWeights) -> AdminReply:
        return await asyncio.to_thread(self._sync_checked, update)

    async def leave_weight_sync(self, group_name: str) -> AdminReply:
        return await asyncio.to_thread(self.worker.destroy_weights_update_group, group_name)

    def _join(self, init: WeightSyncInit) -> AdminReply:
        try:
            weight_sync_init(init)
        except InvalidRequestError as e:
            return AdminReply(error=e.message)
        return self.worker.init_weights_update_group(init)

    def _sync(self, update: DistributedWeights) -> AdminReply:
        try:
            return self._sync_checked(update)
        except InvalidRequestError as e:
            return AdminReply(error=e.message)

    def _sync_checked(self, update: DistributedWeights) -> AdminReply:
        try:
            distributed_weights(update)
        except InvalidRequestError as e:  # the stream's position is lost: a later update would read stale bytes
            if self.worker.destroy_weights_update_group(update.group_name).error is None:
                e = closed_group(e, update.group_name)
            raise e from None
        if self.worker.sync_groups.get(update.group_name) is None:  # refused before any request waits
            return AdminReply(error=f"weight update group {update.group_name!r} does not exist: "
                                    "init_weights_update_group first")
        received: list[bool] = []

        def receive() -> AdminReply:
            received.append(True)
            return self.worker.update_weights_from_distributed(update)

        reply = self._update(receive, update.abort_all_requests, update.flush_cache, update.weight_version)
        if not received:  # refused first (the weights asleep, the scheduler stopped): nothing took the broadcast
            self.worker.destroy_weights_update_group(update.group_name)
            reply.error = closed_group(InvalidRequestError(reply.error or ""), update.group_name).message
        return reply

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's LLM.collective_rpc for its RL recipe, "reload_weights" only: reload_weights() reads the served
        checkpoint folder again (a trainer wrote new weights there); reload_weights(weights_iterator=...) loads
        (name, tensor) pairs, as update_weights_from_tensor. One result per rank, as vLLM's (None: done);
        InvalidRequestError naming the problem when it fails (the old weights still serve)."""
        if method != "reload_weights":
            raise InvalidRequestError(f"collective_rpc supports only 'reload_weights', not {method!r}", param="method")
        call = {**dict(zip(("weights_iterator", "process_weights_after_loading"), args)), **(kwargs or {})}
        weights = call.get("weights_iterator")
        if weights is None:
            ok, message, _ = self.update_weights_from_disk(self.model_path)
        else:
            ok, message = self.update_weights_from_tensor(list(weights))
        if not ok:
            raise InvalidRequestError(message, param="reload_weights")
        return [None]

    # ---- sleep mode ------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1, abort_all_requests: bool = False) -> None:
        """vLLM's LLM.sleep: level 1 offloads the weights to host memory and discards the KV cache (wake_up
        serves the same model again); level 2 discards both (load new weights after wake_up, e.g.
        update_weights_from_disk). The prefix cache is flushed; generate raises EngineAsleepError until
        wake_up. InvalidRequestError while requests run (abort_all_requests=True aborts them instead); a
        sleep while asleep does nothing (as vLLM's)."""
        _check(self._memory(sleep_control(True, level, None, abort_all_requests)), "sleep")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's LLM.wake_up: tags None (all), ["weights"] or ["kv_cache"] (e.g. the weights first, update
        them, then the KV cache: the peak stays lower); CUDA graphs come back with the last one. Waking what is
        awake does nothing."""
        _check(self._memory(sleep_control(False, 1, tags)), "tags")

    def is_sleeping(self) -> bool:
        return bool(self.host.asleep)

    def release_memory_occupation(self, tags: list[str] | None = None, level: int = 1) -> None:
        """SGLang's Engine.release_memory_occupation: tags weights / kv_cache / cuda_graph (None: all). Shoal
        keeps the weights in host memory (level 1, as SGLang with --enable-weights-cpu-backup) unless level=2."""
        _check(self._memory(sleep_control(True, level, tags)), "tags")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """SGLang's Engine.resume_memory_occupation (wake_up)."""
        self.wake_up(tags)

    async def memory_sleep(self, ctl: SleepControl) -> AdminReply:
        return await asyncio.to_thread(self._memory, ctl)  # waits for the running step and the copies

    async def sleeping_tags(self) -> list[str]:
        return list(self.host.asleep)

    def _memory(self, ctl: SleepControl) -> AdminReply:
        try:
            return self.host.memory_sleep(ctl, lambda: self.worker.memory_sleep(ctl))
        except ShoalError as e:  # the scheduler stopped or did not answer
            return AdminReply(error=str(e), sleeping_tags=list(self.host.asleep))

    # ---- pause (SGLang's /pause_generation, /continue_generation) -----------------------------------------
    def pause_generation(self, mode: str = "abort") -> None:
        """No step runs until continue_generation; new requests wait. mode "abort" (SGLang's default) aborts
        every request, "retract" puts the running ones back in the queue (their KV recomputed on continue),
        "in_place" keeps them and their KV. Update the weights meanwhile, then continue. InvalidRequestError:
        a bad mode (or DP attention)."""
        _check(self._pause(pause_control(mode)), "mode")

    def continue_generation(self) -> None:
        """Steps run again and the requests that waited go in; without a pause it does nothing."""
        _check(self._continue(), "mode")

    async def pause_steps(self, ctl: PauseControl) -> AdminReply:
        return await asyncio.to_thread(self._pause, ctl)  # waits for the step in progress: off the loop

    async def continue_steps(self) -> AdminReply:
        return await asyncio.to_thread(self._continue)

    def _pause(self, ctl: PauseControl) -> AdminReply:
        try:
            return self.host.pause_generation(ctl.mode)
        except InvalidRequestError as e:
            return AdminReply(error=e.message)
        except EngineUnavailableError:  # unhealthy (a hung step): the caller's 503, not a refused request
            raise
        except ShoalError as e:  # the scheduler stopped or did not answer
            return AdminReply(error=str(e))

    def _continue(self) -> AdminReply:
        try:
            return self.host.continue_generation()
        except EngineUnavailableError:
            raise
        except ShoalError as e:
            return AdminReply(error=str(e))

    def get_weight_version(self) -> str:
        return self.host.weight_version

    async def update_weights(self, update: WeightUpdate) -> AdminReply:
        return await asyncio.to_thread(self._update_from_disk, update)  # waits for the running requests

    async def current_weight_version(self) -> str:
        return self.host.weight_version

    def _update_from_disk(self, update: WeightUpdate) -> AdminReply:
        reply = self._update(lambda: self.worker.update_weights(update), update.abort_all_requests,
                             update.flush_cache, update.weight_version)
        if reply.error is None:
            self.model_path = update.model_path  # /get_model_info's model_path, as SGLang's
        return reply

    def _update(self, apply: Callable[[], AdminReply], abort_all: bool, flush: bool,
                weight_version: str | None) -> AdminReply:
        try:
            return self.host.update_weights(apply, bool(abort_all), bool(flush), weight_version)
        except EngineUnavailableError:
            raise
        except ShoalError as e:  # the scheduler stopped or did not answer
            return AdminReply(error=str(e))

    async def flush_prefix_cache(self) -> AdminReply:
        return await asyncio.to_thread(self.host.flush_cache)  # waits for the step in progress: off the loop

    async def profile(self, ctl: ProfileControl) -> AdminReply:
        return await asyncio.to_thread(self.host.profile, ctl)


def _pair(reply: AdminReply) -> tuple[bool, str]:
    return reply.error is None, reply.error or reply.message


def _check(reply: AdminReply, param: str = "profile") -> AdminReply:
    if reply.error is not None:
        raise InvalidRequestError(reply.error, param=param)
    return reply
