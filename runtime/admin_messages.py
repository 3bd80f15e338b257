"""Typed operator messages (kept here: messages.py is at its size limit) — what crosses a thread or an actor
boundary when an operator flushes the prefix cache (SGLang's /flush_cache, vLLM's /reset_prefix_cache) or
profiles the workers' steps (/start_profile, /stop_profile): the ProfileControl every TP rank applies at
the same step boundary, the WeightUpdate every TP rank of every replica loads (SGLang's
/update_weights_from_disk) once every replica has answered the UpdateProbe (would it take one now), the
WeightSyncInit / DistributedWeights of a trainer's process group (SGLang's /init_weights_update_group,
/update_weights_from_distributed), the SleepControl every TP rank applies to give its device memory back or
take it again (vLLM's /sleep and /wake_up, SGLang's /release_memory_occupation and /resume_memory_occupation),
the PauseControl of SGLang's /pause_generation, and the AdminReply each replica answers with (no exception
pickling)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import msgspec

from runtime.errors import EngineUnavailableError, InvalidRequestError

if TYPE_CHECKING:
    from runtime.config import ServerArgs

PROFILE_DIR_ENV = "SHOAL_TORCH_PROFILER_DIR"
PROFILE_ACTIVITIES = ("CPU", "CUDA")
WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"  # SGLang's memory tags (vLLM's wake_up tags)
SLEEP_TAGS = (WEIGHTS, KV_CACHE)  # what is released; CUDA graphs go with either (memory_sleep.py)
SYNC_GROUP, SYNC_BACKENDS = "weight_update_group", ("gloo", "nccl")  # SGLang's default group name; backends
PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's PauseGenerationReqInput modes ("abort" its default)
SYNC_TIMEOUT_MAX_S = 7 * 24 * 3600.0  # a week: far below where timedelta(seconds=...) overflows (~8.6e13)
SYNC_DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int8", "uint8", "int16",
               "int32", "int64", "bool")  # what a trainer's broadcast may carry (torch's names)


class EngineAsleepError(EngineUnavailableError):
    """A request while the engine sleeps (the gateway's 503): its weights or KV cache are released."""

    def __init__(self, tags: list[str] | tuple[str, ...]):
        super().__init__(f"the engine is asleep ({', '.join(tags)} released by sleep / release_memory_occupation): "
                         "call wake_up (POST /wake_up or /resume_memory_occupation) before generating")
        self.tags = list(tags)

    def __reduce__(self):
        return type(self), (self.tags,)


class ProfileControl(msgspec.Struct, frozen=True, kw_only=True):
    """Start (start=True) or stop a torch.profiler trace of each TP rank's steps. A start with num_steps
    stops by itself after that many steps; each rank writes <output_dir>/<trace_id>-tp<rank>.trace.json."""

    start: bool
    output_dir: str = ""
    trace_id: str = ""  # the file name's stem, one per start, shared by every rank and replica
    num_steps: int | None = None
    activities: tuple[str, ...] = PROFILE_ACTIVITIES  # CUDA only counts where CUDA exists
    with_stack: bool = False
    record_shapes: bool = False


class WeightUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """SGLang's UpdateWeightFromDiskReqInput, the fields Shoal acts on: a checkpoint of the serving model's
    architecture and shapes (and quantization_config) loaded into the live parameters of every TP rank."""

    model_path: str
    load_format: str | None = None  # None, "auto" or "safetensors" (what --load-format reads)
    abort_all_requests: bool = False  # abort every request first, instead of letting the running ones finish
    weight_version: str | None = None  # /get_model_info's weight_version from here on (None: "update-<n>")
    flush_cache: bool = True  # drop the cached prefixes (their KV came from the old weights)


class UpdateProbe(msgspec.Struct, frozen=True, kw_only=True):
    """"Would you take this weight update now?", asked of every replica before any of them loads one (a refusal
    on one refuses it on all: replicas never serve different weights over it). The fields of a WeightUpdate or
    DistributedWeights that decide a refusal (SchedulerHost.check_update); the AdminReply's error says why not."""

    flush_cache: bool = True
    abort_all_requests: bool = False  # the running requests end first: none keeps KV the flush would strand

    @staticmethod
    def of(update: WeightUpdate | DistributedWeights) -> UpdateProbe:
        return UpdateProbe(flush_cache=update.flush_cache, abort_all_requests=update.abort_all_requests)


class WeightSyncInit(msgspec.Struct, frozen=True, kw_only=True):
    """SGLang's InitWeightsUpdateGroupReqInput: join a trainer's process group (the trainer is rank 0; TP rank
    r joins at rank_offset + r). runtime/model_executor/weight_sync_group.py says how."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = SYNC_GROUP
    backend: str = "nccl"
    timeout_s: float = 1800.0  # joining, and each broadcast (torch's default process-group timeout)


class DistributedWeights(msgspec.Struct, frozen=True, kw_only=True):
    """SGLang's UpdateWeightsFromDistributedReqInput: the trainer broadcasts these HF-named tensors from rank 0,
    in this order, over group_name; every TP rank receives them and loads them as a tensor update."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = SYNC_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None  # None or "direct" (SGLang's field)


class WeightSyncLeave(msgspec.Struct, frozen=True, kw_only=True):
    """SGLang's DestroyWeightsUpdateGroupReqInput."""

    group_name: str = SYNC_GROUP


def weight_sync_init(init: WeightSyncInit) -> WeightSyncInit:
    """Checked (InvalidRequestError naming the field); the TP ranks' own bounds are checked where they join."""
    if not init.group_name:
        raise InvalidRequestError("group_name is empty", param="group_name")
    if init.backend not in SYNC_BACKENDS:
        raise InvalidRequestError(f"backend must be one of {', '.join(SYNC_BACKENDS)}, got {init.backend!r}",
                                  param="backend")
    if not init.master_address or not 0 < init.master_port < 65536:
        raise InvalidRequestError(f"master_address:master_port {init.master_address!r}:{init.master_port} is not "
                                  "an address to reach the trainer's rank 0 at", param="master_port")
    if init.rank_offset < 1 or init.world_size <= init.rank_offset:  # rank 0 is the trainer's
        raise InvalidRequestError(f"rank_offset must be at least 1 (rank 0 is the trainer) and below world_size, got "
                                  f"rank_offset {init.rank_offset}, world_size {init.world_size}", param="rank_offset")
    if not 0 < init.timeout_s <= SYNC_TIMEOUT_MAX_S:  # NaN fails too
        raise InvalidRequestError(f"timeout_s must be positive and at most {SYNC_TIMEOUT_MAX_S:.0f} (a week), got "
                                  f"{init.timeout_s}", param="timeout_s")
    return init


def distributed_weights(update: DistributedWeights) -> DistributedWeights:
    """Checked before anything is received (InvalidRequestError naming the field; the caller closes the group:
    closed_group). Whether the names and shapes fit the model is checked after receiving all of it."""
    if not len(update.names) == len(update.dtypes) == len(update.shapes):
        raise InvalidRequestError(f"names, dtypes and shapes must be lists of the same length, got "
                                  f"{len(update.names)}, {len(update.dtypes)}, {len(update.shapes)}", param="names")
    if not update.names:
        raise InvalidRequestError("names is empty: name the tensors the trainer broadcasts", param="names")
    if update.load_format not in (None, "direct"):
        raise InvalidRequestError(f"load_format {update.load_format!r} is not supported for tensors: omit it",
                                  param="load_format")
    for name, dtype, shape in zip(update.names, update.dtypes, update.shapes):
        if dtype.removeprefix("torch.") not in SYNC_DTYPES:
            raise InvalidRequestError(f"{name}: dtype {dtype!r} is not one of {', '.join(SYNC_DTYPES)}", param="dtypes")
        if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise InvalidRequestError(f"{name}: shape {shape} is not a list of non-negative sizes", param="shapes")
    return update


def closed_group(e: InvalidRequestError, group_name: str) -> InvalidRequestError:
    """Metadata no rank could receive by: the error, saying the group was closed (so the trainer's broadcast
    fails instead of waiting for its timeout, and no later update reads its leftovers) and must be joined again."""
    return InvalidRequestError(f"{e.message}; weight update group {group_name!r} was closed, as the broadcast "
                               "that goes with it cannot be received: init_weights_update_group again", param=e.param)


class SleepControl(msgspec.Struct, frozen=True, kw_only=True):
    """Release (sleep=True) or take back (sleep=False) a replica's device memory on every TP rank: vLLM's
    sleep(level) / wake_up(tags), SGLang's release / resume_memory_occupation(tags). Level 1 keeps the weights
    in host memory, level 2 discards them (load new ones after waking up). abort_all_requests: a sleep aborts
    the running requests instead of refusing while any runs."""

    sleep: bool
    level: int = 1
    tags: tuple[str, ...] = SLEEP_TAGS
    abort_all_requests: bool = False
    # wake_up: capture the CUDA graphs once nothing is released. A TP group over Ray restores every rank's
    # memory first (False) and only then captures on all ranks at once (a wake_up of tags (cuda_graph,)).
    graphs: bool = True


def sleep_control(sleep: bool, level: int = 1, tags: list[str] | tuple[str, ...] | None = None,
                  abort_all_requests: bool = False) -> SleepControl:
    """Checked (InvalidRequestError naming level or tags): tags None or empty mean all of them."""
    if isinstance(level, bool) or not isinstance(level, int) or level not in (1, 2):
        raise InvalidRequestError(f"level must be 1 (keep the weights in host memory) or 2 (discard them), got "
                                  f"{level!r}", param="level")
    if isinstance(tags, str):
        tags = [tags]
    unknown = [t for t in tags or () if t not in (*SLEEP_TAGS, CUDA_GRAPH)]
    if unknown:
        raise InvalidRequestError(f"unknown memory tag(s) {unknown}: use {', '.join((*SLEEP_TAGS, CUDA_GRAPH))}",
                                  param="tags")
    if sleep and tags and not any(t in SLEEP_TAGS for t in tags):  # an awake engine answered "already asleep"
        raise InvalidRequestError("cuda_graph alone is not released: the graphs go with weights or kv_cache",
                                  param="tags")
    return SleepControl(sleep=bool(sleep), level=level, tags=tuple(dict.fromkeys(tags)) if tags else SLEEP_TAGS,
                        abort_all_requests=bool(abort_all_requests))


class PauseControl(msgspec.Struct, frozen=True, kw_only=True):
    """SGLang's PauseGenerationReqInput: no step runs until continue_generation (SchedulerHost.pause_generation
    says what each mode does to the requests in the scheduler)."""

    mode: str = "abort"


def pause_control(mode: str = "abort") -> PauseControl:
    """Checked: InvalidRequestError naming mode for anything but SGLang's three."""
    if mode not in PAUSE_MODES:
        raise InvalidRequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode")
    return PauseControl(mode=mode)


class AdminReply(msgspec.Struct, kw_only=True):
    """One replica's answer (summed over replicas by a client over several). error None: done."""

    error: str | None = None
    flushed_tokens: int = 0  # /flush_cache: cached tokens dropped (their KV slots freed)
    kept_tokens: int = 0  # /flush_cache: cached tokens kept because running requests use them
    trace_files: list[str] = []  # /stop_profile (or num_steps' end): the traces this rank 0 wrote
    message: str = ""  # a weight update's report (what was loaded, in how long)
    num_paused_requests: int = 0  # a weight update: requests that arrived during it and waited for it
    weight_version: str = ""  # a weight update: the version serving from now on
    sleeping_tags: list[str] = []  # sleep / wake_up: what stays released (empty: awake)

    @staticmethod
    def combined(replies: list[AdminReply]) -> AdminReply:
        errors = [r.error for r in replies if r.error]
        return AdminReply(error=errors[0] if errors else None, flushed_tokens=sum(r.flushed_tokens for r in replies),
                          kept_tokens=sum(r.kept_tokens for r in replies),
                          trace_files=[f for r in replies for f in r.trace_files],
                          message=" | ".join(dict.fromkeys(r.message for r in replies if r.message)),
                          num_paused_requests=sum(r.num_paused_requests for r in replies),
                          weight_version=next((r.weight_version for r in replies if r.weight_version), ""),
                          sleeping_tags=sorted({t for r in replies for t in r.sleeping_tags}))


def profile_dir(args: ServerArgs) -> str:
    """Where traces go: --profile-dir, else $SHOAL_TORCH_PROFILER_DIR; InvalidRequestError (a 400) saying how
    to set one when neither is (as vLLM refuses without VLLM_TORCH_PROFILER_DIR)."""
    where = args.profile_dir or os.environ.get(PROFILE_DIR_ENV, "")
    if not where:
        raise InvalidRequestError(f"profiling is off: start the server with --profile-dir DIR (or set "
                                  f"{PROFILE_DIR_ENV}=DIR) to have each TP rank write its trace there",
                                  param="profile_dir")
    return where


def check_activities(activities: list[str] | None) -> tuple[str, ...]:
    """SGLang's `activities` (["CPU", "GPU"], ...) as ours; InvalidRequestError naming an unknown one."""
    if activities is None:
        return PROFILE_ACTIVITIES
    out = []
    for a in activities:
        name = {"GPU": "CUDA"}.get(str(a).upper(), str(a).upper())
        if name not in PROFILE_ACTIVITIES:
            raise InvalidRequestError(f"unknown profiler activity {a!r}; use CPU and/or GPU (CUDA)", param="activities")
        out.append(name)
    if not out:
        raise InvalidRequestError("activities is empty: give CPU and/or GPU", param="activities")
    return tuple(dict.fromkeys(out))


def profile_control(args: ServerArgs, num_steps: int | None = None, activities: list[str] | None = None,
                    with_stack: bool = False, record_shapes: bool = False) -> ProfileControl:
    """A start, checked (InvalidRequestError naming the parameter), with a fresh trace_id."""
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
        raise InvalidRequestError(f"num_steps must be a positive integer, got {num_steps!r}", param="num_steps")
    return ProfileControl(start=True, output_dir=profile_dir(args), num_steps=num_steps,
                          trace_id=f"shoal-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6:06d}",
                          activities=check_activities(activities), with_stack=bool(with_stack),
                          record_shapes=bool(record_shapes))
