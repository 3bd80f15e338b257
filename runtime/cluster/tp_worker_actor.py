"""TpWorkerActor: a TP rank other than 0, as a Ray actor. It holds its shard (TpRank) and, once
started, follows rank 0: every step's WorkerBatch arrives over the StepChannel and is launched at
once, so the ranks' device queues stay full and the TP collectives meet. No result travels back: the
collectives make every rank's logits, and so its sampled tokens, the same as rank 0's. So a follower does
only what its next step needs: its sampled tokens stay on the device (the next step reads them from
there), it never waits for its device (rank 0 paces the group: it sends a step only after collecting
the one two before), and it skips the logprobs only rank 0 reports.

serve() runs the follow loop for the replica's life (the group is killed as a whole); it ends with the
rank's own exception if a step fails, which is how rank 0's SchedulerActor (which awaits it) learns why.
The actor is threaded, so node_id(), inject_fault(), trace_steps(), add_lora(), the weight updates (a
trainer's broadcast ones too) and memory_sleep answer while serve() runs (rank 0 sends no step while it updates or sleeps: the loop waits in
recv meanwhile)."""

from __future__ import annotations

import logging
import os
import time

import msgspec

from runtime.admin_messages import AdminReply, DistributedWeights, SleepControl, WeightSyncInit, WeightUpdate
from runtime.cluster.step_trace import StepTrace
from runtime.cluster.tp_rank import RankSpec, TpRank, endpoint, local_model_path
from runtime.config import ServerArgs
from runtime.errors import InvalidRequestError
from runtime.gc_guard import GcGuard
from runtime.logging_setup import setup_logging
from runtime.messages import LoraLoad, LoraUpdate, WorkerBatch, WorkerInfo
from runtime.model_executor.forward_mode import ForwardMode

logger = logging.getLogger(__name__)


class TpWorkerActor:
    def __init__(self, args: ServerArgs, model_path: str, spec: RankSpec):
        setup_logging(args.log_level)  # a Ray worker's loggers otherwise print WARNING and up, bare
        self.args, self.model_path, self.spec = args, model_path, spec
        self.rank: TpRank | None = None
        self._fault: tuple[int, str] | None = None
        self._trace: StepTrace | None = None

    def endpoint(self) -> tuple[str, int]:
        return endpoint()

    def init(self, master_addr: str, master_port: int) -> WorkerInfo:
        self.model_path = local_model_path(self.args, self.model_path)
        self.rank = TpRank.join(self.args, self.model_path, self.spec, master_addr, master_port)
        return self.rank.worker.info()

    def serve(self) -> None:
        """Follows rank 0 until a step fails (raises) or the actor is killed."""
        worker, channel = self.rank.worker, self.rank.channel
        worker.bind_thread()
        GcGuard(f"tp rank {self.spec.rank}").start()  # a collection here stalls every rank's step
        decoder = msgspec.msgpack.Decoder(WorkerBatch)
        clock = time.monotonic_ns
        while True:
            wait_ns = clock()
            frame = channel.recv()
            self._maybe_fault()
            trace = self._trace  # read after the wait: a trace started while idle sees its first step
            recv_ns = clock() if trace is not None else 0
            batch = decoder.decode(frame.data)
            if batch.profile is not None:  # a control frame from rank 0, applied between the same two steps
                reply = worker.profile(batch.profile)
                if reply.error is not None:
                    logger.warning("TP rank %d: %s", self.spec.rank, reply.error)
                continue
            if batch.sampling is not None:
                batch.sampling.return_logprob = False  # rank 0 reports logprobs; they never change a token
            decoded_ns = clock() if trace is not None else 0
            launched = worker.launch_batch(batch, keep_on_device=True)
            if trace is not None:
                trace.record(frame.meta, frame.sent_ns, wait_ns, recv_ns, decoded_ns, clock(),
                             ForwardMode(batch.forward_mode).is_decode(), launched.events)

    def add_lora(self, load: LoraLoad) -> LoraUpdate:
        """Rank 0, before it serves an adapter loaded at run time: this rank reads its shard too (host memory
        only, beside the follow loop; the slots load with the batches that first use it)."""
        try:
            self.rank.worker.add_lora(load)
        except InvalidRequestError as e:
            return LoraUpdate(error=f"TP rank {self.spec.rank}: {e.message}")
        return LoraUpdate()

    def check_weights(self, update: WeightUpdate) -> AdminReply:
        """Rank 0, before any rank loads: this rank's shard of the checkpoint is checked (nothing copied)."""
        self.rank.worker.bind_thread()  # a call runs on one of the actor's threads, not the follow loop's
        reply = self.rank.worker.check_weights(update)
        return AdminReply(error=f"TP rank {self.spec.rank}: {reply.error}") if reply.error else reply

    def update_weights(self, update: WeightUpdate, checked: bool = False) -> AdminReply:
        self.rank.worker.bind_thread()
        reply = self.rank.worker.update_weights(update, checked)
        return AdminReply(error=f"TP rank {self.spec.rank}: {reply.error}") if reply.error else reply

    # ---- weights a trainer broadcasts (weight_sync_group.py): rank 0 calls these at the same time as its own
    def init_weights_update_group(self, init: WeightSyncInit) -> AdminReply:
        """Joins the trainer's group as rank_offset + this TP rank (waits for every member)."""
        return self._ranked(self.rank.worker.init_weights_update_group(init, self.spec.rank))

    def destroy_weights_update_group(self, group_name: str) -> AdminReply:
        return self._ranked(self.rank.worker.destroy_weights_update_group(group_name))

    def receive_weights(self, update: DistributedWeights) -> AdminReply:
        self.rank.worker.bind_thread()
        return self._ranked(self.rank.worker.receive_weights(update))

    def load_received(self, _: object = None) -> AdminReply:
        self.rank.worker.bind_thread()
        return self._ranked(self.rank.worker.load_received())

    def drop_received(self, _: object = None) -> AdminReply:
        return self.rank.worker.drop_received()

    def _ranked(self, reply: AdminReply) -> AdminReply:
        return msgspec.structs.replace(reply, error=f"TP rank {self.spec.rank}: {reply.error}") if reply.error else reply

    def memory_sleep(self, ctl: SleepControl) -> AdminReply:
        """Rank 0, at the same time as it does its own (a wake_up captures CUDA graphs, whose warm-up steps
        meet in the TP collectives): this rank releases or restores its memory."""
        self.rank.worker.bind_thread()
        reply = self.rank.worker.memory_sleep(ctl)
        return msgspec.structs.replace(reply, error=f"TP rank {self.spec.rank}: {reply.error}") if reply.error else reply

    def trace_steps(self, on: bool) -> dict | None:
        """Benchmarks: on=True starts a fresh StepTrace of the follow loop; on=False stops it and returns
        its summary (step_trace.py says what each number means)."""
        trace, self._trace = self._trace, StepTrace() if on else None
        if trace is None or on:
            return None
        return {"channel": self.rank.channel.kind} | trace.summary()

    def step_channel(self) -> str:
        """The StepChannel kind this rank follows over ("shm" or "gloo")."""
        return self.rank.channel.kind

    def inject_fault(self, after_steps: int, message: str) -> None:
        """Failure drills and tests: the step after the next `after_steps` raises RuntimeError(message)."""
        self._fault = (after_steps, message)

    def _maybe_fault(self) -> None:
        if self._fault is not None:
            left, message = self._fault
            self._fault = (left - 1, message) if left > 0 else None
            if left == 0:
                raise RuntimeError(message)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        """This actor's OS process (chaos tests SIGKILL it)."""
        return os.getpid()
