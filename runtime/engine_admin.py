"""EngineAdmin: the in-process Engine's operator calls (kept here: engine.py is at its size limit) — SGLang's
Engine.flush_cache and vLLM's LLM.reset_prefix_cache, Engine.start_profile / stop_profile (SGLang's and
vLLM's names), and the EngineClient side the gateway's /flush_cache, /reset_prefix_cache, /start_profile and
/stop_profile call. Each runs on the scheduler thread between two steps (SchedulerHost.call)."""

from __future__ import annotations

import asyncio
from typing import Any

from runtime.admin_messages import AdminReply, ProfileControl, profile_control
from runtime.errors import InvalidRequestError


class EngineAdmin:
    host: Any  # SchedulerHost (Engine sets it)
    args: Any  # ServerArgs

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

    async def flush_prefix_cache(self) -> AdminReply:
        return await asyncio.to_thread(self.host.flush_cache)  # waits for the step in progress: off the loop

    async def profile(self, ctl: ProfileControl) -> AdminReply:
        return await asyncio.to_thread(self.host.profile, ctl)


def _check(reply: AdminReply) -> AdminReply:
    if reply.error is not None:
        raise InvalidRequestError(reply.error, param="profile")
    return reply
