"""StepFrame: one message of a StepChannel as its reader gets it — the bytes, when rank 0 sent them, and a
few integers rank 0 attaches (BroadcastWorker: the step's id and its own timestamps, for step traces)."""

from __future__ import annotations

from dataclasses import dataclass

META_SLOTS = 8


@dataclass(frozen=True, slots=True)
class StepFrame:
    data: bytes
    sent_ns: int  # time.monotonic_ns() on the sender just before sending (one clock per node)
    meta: tuple[int, ...]  # META_SLOTS integers
