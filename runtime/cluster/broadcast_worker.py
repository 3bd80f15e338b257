"""BroadcastWorker: rank 0's WorkerClient when its TP group has other ranks. Every batch is encoded
once and sent over the StepChannel before rank 0 launches its own share, so all ranks start the step
together with no RPC; each message carries rank 0's recent timestamps (LeaderStamps) for step traces.
Any failure — of rank 0's own step, or reported for a peer by fail() — leaves the group failed for good: its ranks may be out of step, so only a relaunch can recover it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from runtime.admin_messages import AdminReply, ProfileControl
from runtime.cluster.leader_stamps import LeaderStamps
from runtime.distributed.step_channel import StepChannel
from runtime.errors import EngineUnavailableError
from runtime.messages import BatchResult, WorkerBatch
from runtime.model_executor.tp_worker import TpWorker

logger = logging.getLogger(__name__)


class BroadcastWorker:
    def __init__(self, worker: TpWorker, channel: StepChannel, name: str,
                 on_failure: Callable[[EngineUnavailableError], None]):
        self.worker, self.channel, self.name, self.on_failure = worker, channel, name, on_failure
        self.can_overlap = worker.can_overlap
        self.failed: EngineUnavailableError | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self.stamps = LeaderStamps()

    def bind_thread(self) -> None:
        self.worker.bind_thread()

    def launch_batch(self, batch: WorkerBatch) -> object:
        self._check()
        try:
            self.channel.send(self._encoder.encode(batch), self.stamps.meta(batch.batch_id))
            launched = self.worker.launch_batch(batch)
            self.stamps.launched(batch.batch_id)
            return launched
        except Exception as e:
            raise self._failure(e) from None

    def finish_batch(self, launched: object) -> BatchResult:
        self._check()
        try:
            call_ns = time.monotonic_ns()
            result = self.worker.finish_batch(launched)
            self.stamps.finished(launched, call_ns)
            return result
        except Exception as e:
            raise self._failure(e) from None

    def run_batch(self, batch: WorkerBatch) -> BatchResult:
        return self.finish_batch(self.launch_batch(batch))

    def profile(self, ctl: ProfileControl) -> AdminReply:
        """The other ranks get it as a control frame between two steps, so every rank traces the same steps."""
        self._check()
        reply = self.worker.profile(ctl)
        if reply.error is None:
            try:
                self.channel.send(self._encoder.encode(control_frame(ctl)))
            except Exception as e:
                raise self._failure(e) from None
        return reply

    def fail(self, message: str) -> EngineUnavailableError:
        """Marks the group failed (idempotent: the first reason wins) and tells the owner once."""
        if self.failed is None:
            self.failed = EngineUnavailableError(message)
            self.channel.abort()  # a send waiting on a dead rank gives up
            logger.error("%s", message)
            self.on_failure(self.failed)
        return self.failed

    def _check(self) -> None:
        if self.failed is not None:
            raise self.failed

    def _failure(self, e: Exception) -> EngineUnavailableError:
        if self.failed is not None:  # a peer's death broke this step: report the peer, not the symptom
            return self.failed
        return self.fail(f"TP worker rank 0 of {self.name} failed: {describe_exception(e)}")


def describe_exception(e: BaseException) -> str:
    """'Type: first line' of an exception; a RayTaskError's own first line only names the remote method,
    the worker's exception is its cause."""
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__


def control_frame(ctl: ProfileControl) -> WorkerBatch:
    """A WorkerBatch that runs nothing (batch_id -1): it only carries `ctl` to the following ranks."""
    return WorkerBatch(batch_id=-1, forward_mode=0, input_ids=[], req_pool_indices=[], seq_lens=[], prefix_lens=[],
                       out_cache_loc=[], profile=ctl)
