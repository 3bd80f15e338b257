"""WorkerClient: the seam between the Scheduler and whatever runs its batches — an in-process TpWorker,
or rank 0 of a TP group that forwards every batch to its peers (runtime.cluster.broadcast_worker)."""

from __future__ import annotations

from typing import Protocol

from runtime.admin_messages import AdminReply, ProfileControl
from runtime.messages import BatchResult, WorkerBatch


class WorkerClient(Protocol):
    # True when launch_batch returns before the device finishes, so the scheduler gains by preparing
    # batch N+1 while batch N runs (overlap scheduling). A synchronous worker (CPU) says False.
    can_overlap: bool
    # Optional: launch_batch(batch, sample_later=True) then sample_deferred(handle, rows, mask) (TpWorker).
    # Overlap scheduling then keeps running with grammar-constrained requests in the batch.
    can_defer_sampling: bool = False

    def bind_thread(self) -> None:
        """Called once on the thread that will drive this worker (selects its GPU for that thread)."""

    def run_batch(self, batch: WorkerBatch) -> BatchResult: ...

    def launch_batch(self, batch: WorkerBatch) -> object:
        """Enqueues the batch; finish_batch(returned handle) waits for and returns its result."""

    def finish_batch(self, launched: object) -> BatchResult: ...

    def profile(self, ctl: ProfileControl) -> AdminReply:
        """Starts or stops a trace of every TP rank's steps; called on the thread that drives this worker."""
