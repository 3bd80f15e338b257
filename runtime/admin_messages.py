"""Typed operator messages (kept here: messages.py is at its size limit) — what crosses a thread or an actor
boundary when an operator flushes the prefix cache (SGLang's /flush_cache, vLLM's /reset_prefix_cache) or
profiles the workers' steps (/start_profile, /stop_profile): the ProfileControl every TP rank applies at
the same step boundary, the WeightUpdate every TP rank of every replica loads (SGLang's
/update_weights_from_disk), and the AdminReply each replica answers with (no exception pickling)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import msgspec

from runtime.errors import InvalidRequestError

if TYPE_CHECKING:
    from runtime.config import ServerArgs

PROFILE_DIR_ENV = "SHOAL_TORCH_PROFILER_DIR"
PROFILE_ACTIVITIES = ("CPU", "CUDA")


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


class AdminReply(msgspec.Struct, kw_only=True):
    """One replica's answer (summed over replicas by a client over several). error None: done."""

    error: str | None = None
    flushed_tokens: int = 0  # /flush_cache: cached tokens dropped (their KV slots freed)
    kept_tokens: int = 0  # /flush_cache: cached tokens kept because running requests use them
    trace_files: list[str] = []  # /stop_profile (or num_steps' end): the traces this rank 0 wrote
    message: str = ""  # a weight update's report (what was loaded, in how long)
    num_paused_requests: int = 0  # a weight update: requests that arrived during it and waited for it
    weight_version: str = ""  # a weight update: the version serving from now on

    @staticmethod
    def combined(replies: list[AdminReply]) -> AdminReply:
        errors = [r.error for r in replies if r.error]
        return AdminReply(error=errors[0] if errors else None, flushed_tokens=sum(r.flushed_tokens for r in replies),
                          kept_tokens=sum(r.kept_tokens for r in replies),
                          trace_files=[f for r in replies for f in r.trace_files],
                          message=" | ".join(dict.fromkeys(r.message for r in replies if r.message)),
                          num_paused_requests=sum(r.num_paused_requests for r in replies),
                          weight_version=next((r.weight_version for r in replies if r.weight_version), ""))


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
