"""StepHealth: whether one scheduler's steps still work (EngineClient.health, GET /health).

A step that raises fails the requests it held and the scheduler serves on (Scheduler.run_forever): most such
failures are one batch's. But some errors leave the device unusable — a sticky CUDA error (an illegal memory
access, a device-side assert: torch.AcceleratorError) makes every later step fail too — and a server that
answers /health 200 meanwhile is never restarted. So a step that met such an error, or FAILED_STEPS_LIMIT
steps failing in a row, mark the scheduler unhealthy with the reason, for good: new requests are refused
(EngineUnhealthyError, the gateway's 503) and /health answers 503, as vLLM's /health does once its EngineCore
died (EngineDeadError). Only a restart clears it (on Ray, the replica's relaunch). A successful step resets
the count. Out of memory is not fatal (the allocator recovers); it counts like any other failure."""

from __future__ import annotations

import logging

import torch

from runtime.engine_client import EngineHealth, EngineUnhealthyError

logger = logging.getLogger(__name__)

FAILED_STEPS_LIMIT = 3  # a few in a row: one bad batch (or two) is not a broken engine
# Messages of CUDA errors that stay set in the context: every later kernel launch fails with them.
_FATAL_TEXT = ("CUDA error", "illegal memory access", "device-side assert")
_ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", ())  # torch >= 2.8: a CUDA runtime error


def is_fatal(e: BaseException) -> bool:
    """A device error no later step recovers from, here or anywhere in its chain (a TP rank's error
    arrives wrapped: a Ray task error's `cause`, an exception raised from it)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        text = str(cur)
        if isinstance(cur, torch.OutOfMemoryError) or "out of memory" in text:
            return False
        if isinstance(cur, _ACCELERATOR_ERROR) or any(t in text for t in _FATAL_TEXT):
            return True
        cur = getattr(cur, "cause", None) or cur.__cause__ or cur.__context__
    return False


def _describe(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


class StepHealth:
    """Written on the scheduler thread; `state` is replaced whole, so any thread reads it without a lock."""

    def __init__(self, limit: int = FAILED_STEPS_LIMIT):
        self.limit = limit
        self.failed_in_a_row = 0
        self.state = EngineHealth()

    def succeeded(self) -> None:
        self.failed_in_a_row = 0

    def failed(self, e: BaseException) -> EngineHealth:
        """A step raised e: unhealthy from now on if e is fatal or the limit is reached."""
        self.failed_in_a_row += 1
        if not self.state.healthy:
            return self.state
        if is_fatal(e):
            reason = f"a scheduler step met a device error no later step recovers from ({_describe(e)})"
        elif self.failed_in_a_row >= self.limit:
            reason = f"{self.failed_in_a_row} scheduler steps failed in a row, the last with {_describe(e)}"
        else:
            return self.state
        self.state = EngineHealth(healthy=False, reason=reason)
        logger.critical("the engine is unhealthy: %s", self.state.reason)
        return self.state

    def check(self) -> None:
        """EngineUnhealthyError once unhealthy: a new request would only fail in its first step."""
        if not self.state.healthy:
            raise EngineUnhealthyError(self.state.reason or "unknown")
