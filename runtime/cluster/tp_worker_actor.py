"""TpWorkerActor: a TP rank other than 0, as a Ray actor. It holds its shard (TpRank) and, once
started, follows rank 0: every step's WorkerBatch arrives over the StepChannel and is launched at
once, the previous step collected behind it, exactly as rank 0's scheduler launches and collects — so
the ranks' device queues stay full and the TP collectives meet. No result travels back: the
collectives make every rank's logits, and so its sampled tokens, the same as rank 0's.

serve() runs the follow loop for the replica's life (the group is killed as a whole); it ends with the
rank's own exception if a step fails, which is how rank 0's SchedulerActor (which awaits it) learns why. The actor is threaded, so
node_id() and inject_fault() answer while serve() runs."""

from __future__ import annotations

import os

import msgspec

from runtime.cluster.tp_rank import RankSpec, TpRank, endpoint
from runtime.config import ServerArgs
from runtime.messages import WorkerBatch, WorkerInfo


class TpWorkerActor:
    def __init__(self, args: ServerArgs, model_path: str, spec: RankSpec):
        self.args, self.model_path, self.spec = args, model_path, spec
        self.rank: TpRank | None = None
        self._fault: tuple[int, str] | None = None

    def endpoint(self) -> tuple[str, int]:
        return endpoint()

    def init(self, master_addr: str, master_port: int) -> WorkerInfo:
        self.rank = TpRank.join(self.args, self.model_path, self.spec, master_addr, master_port)
        return self.rank.worker.info()

    def serve(self) -> None:
        """Follows rank 0 until a step fails (raises) or the actor is killed."""
        worker, channel = self.rank.worker, self.rank.channel
        worker.bind_thread()
        decoder = msgspec.msgpack.Decoder(WorkerBatch)
        pending = None
        while True:
            data = channel.recv()
            self._maybe_fault()
            launched = worker.launch_batch(decoder.decode(data))
            if pending is not None:
                worker.finish_batch(pending)
            pending = launched

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
