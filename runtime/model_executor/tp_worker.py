"""TpWorker: one tensor-parallel rank. Holds a ModelRunner and executes WorkerBatches. In one process it
is called directly; under Ray a TpWorkerActor hosts the same class."""

from __future__ import annotations

import logging
import threading

import torch

from runtime.admin_messages import (
    AdminReply,
    DistributedWeights,
    ProfileControl,
    SleepControl,
    WeightSyncInit,
    WeightUpdate,
)
from runtime.config import ServerArgs
from runtime.errors import InvalidRequestError, WeightLoadError
from runtime.messages import BatchResult, LoraLoad, WorkerBatch, WorkerInfo
from runtime.model_executor.memory_sleep import MemorySleep
from runtime.model_executor.model_runner import LaunchedBatch, ModelRunner
from runtime.model_executor.spec_decode_runner import SpecDecodeRunner
from runtime.model_executor.step_profiler import StepProfiler
from runtime.model_executor.weight_sync_group import WeightSyncGroup
from runtime.model_executor.weight_updater import WeightUpdater
from runtime.models.parallel_context import ParallelContext

logger = logging.getLogger(__name__)


class TpWorker:
    """A WorkerClient (runtime.managers.worker_client) for the rank it lives on."""

    # launch_batch/finish_batch split every batch; on CUDA the launch returns before the device is done.
    can_overlap = True
    # launch_batch(sample_later=True) + sample_deferred(): grammar masks join after the forward is queued.
    # One rank only: a TP group's followers get every mask inside the broadcast WorkerBatch instead.
    can_defer_sampling = True

    def __init__(self, args: ServerArgs, model_path: str, ctx: ParallelContext | None = None,
                 device: torch.device | None = None):
        self.runner = ModelRunner(args, model_path, ctx, device)
        self.runner.spec = SpecDecodeRunner.create(args, self.runner)
        self.profiler: StepProfiler | None = None  # /start_profile .. /stop_profile (or its num_steps)
        self.weights = WeightUpdater(self.runner, model_path)  # live weight updates (weight_updater.py)
        self.memory = MemorySleep(self.runner)  # sleep / wake_up between RL rollouts (memory_sleep.py)
        self.sync_groups: dict[str, WeightSyncGroup | None] = {}  # trainers' groups (None: being joined)
        self._sync_lock = threading.Lock()
        self._received: list[tuple[str, torch.Tensor]] | None = None  # received and checked, not loaded yet

    def bind_thread(self) -> None:
        device = self.runner.device
        if device.type == "cuda":  # the current device is per thread; "cuda" alone means the current one
            torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())

    def info(self) -> WorkerInfo:
        r = self.runner
        return WorkerInfo(max_total_tokens=r.max_total_tokens, max_reqs=r.max_running_requests,
                          context_len=r.context_len, vocab_size=r.model_config.vocab_size,
                          eos_token_ids=list(r.model_config.eos_token_ids), attention_backend=r.attn_backend_name,
                          device=str(r.device), all_reduce=r.ctx.mlp.all_reduce_kind,
                          pooling=r.pooler.name if r.pooler is not None else None)

    def profile(self, ctl: ProfileControl) -> AdminReply:
        """Starts or stops this rank's trace. On the thread that runs this worker's steps only (StepProfiler
        says why); a start while one runs, or a stop with none, is an error in the reply."""
        if ctl.start == (self.profiler is not None):
            return AdminReply(error="the profiler is already running: POST /stop_profile first" if ctl.start
                              else "the profiler is not running: POST /start_profile first")
        if ctl.start:
            try:
                self.profiler = StepProfiler(ctl, self.runner.ctx.mlp.rank, self.runner.device)
            except OSError as e:
                return AdminReply(error=f"cannot write traces to {ctl.output_dir!r}: {e}")
            return AdminReply()
        profiler, self.profiler = self.profiler, None
        try:
            return AdminReply(trace_files=[profiler.stop()])
        except OSError as e:
            return AdminReply(error=f"cannot write the trace {profiler.path!r}: {e}")

    def _profiled(self) -> None:
        if self.profiler.step():  # its num_steps are done
            profiler, self.profiler = self.profiler, None
            try:
                profiler.stop()
            except OSError:  # a trace that cannot be written must not fail the step's requests
                logger.exception("cannot write the trace %s", profiler.path)

    # ---- live weight updates: on the thread that runs this worker's steps, between two steps ------------
    def check_weights(self, update: WeightUpdate) -> AdminReply:
        """Checks a checkpoint against the live model, copying nothing (every TP rank checks before any loads)."""
        return _weight_reply(lambda: self.weights.check.check_checkpoint(update.model_path, update.load_format)
                             or "checked")

    def update_weights(self, update: WeightUpdate, checked: bool = False) -> AdminReply:
        """Loads a checkpoint into the live parameters; the reply's error names what did not fit (the old
        weights still serve then)."""
        return _weight_reply(lambda: self.weights.from_disk(update.model_path, update.load_format, checked))

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]]) -> AdminReply:
        return _weight_reply(lambda: self.weights.from_tensors(named_tensors))

    # ---- weights broadcast by a trainer (weight_sync_group.py) --------------------------------------------
    def init_weights_update_group(self, init: WeightSyncInit, local_rank: int = 0) -> AdminReply:
        """Joins the trainer's group as rank_offset + local_rank (this rank's place in its replica) and waits
        for every member. Any thread: the model is not touched, the scheduler keeps serving meanwhile."""
        rank = init.rank_offset + local_rank
        if rank >= init.world_size:
            return AdminReply(error=f"TP rank {local_rank} would join as rank {rank}, outside world_size "
                                    f"{init.world_size}: count every TP rank of the server in world_size")
        with self._sync_lock:
            if init.group_name in self.sync_groups:
                return AdminReply(error=f"weight update group {init.group_name!r} already exists: destroy it first")
            self.sync_groups[init.group_name] = None
        group = None
        try:
            group = WeightSyncGroup(init, rank, self.runner.device)
        except WeightLoadError as e:
            return AdminReply(error=str(e))
        finally:  # any exception too: a placeholder left behind would block the name until a restart
            with self._sync_lock:
                if group is None:
                    del self.sync_groups[init.group_name]
                else:
                    self.sync_groups[init.group_name] = group
        return AdminReply(message="Succeeded to initialize custom process group.")

    def destroy_weights_update_group(self, group_name: str) -> AdminReply:
        with self._sync_lock:
            group = self.sync_groups.get(group_name)
            if group is None:
                return AdminReply(error=f"weight update group {group_name!r} does not exist")
            del self.sync_groups[group_name]
        group.close()  # waits for a receive in progress
        return AdminReply(message="Succeeded to destroy custom process group.")

    def receive_weights(self, update: DistributedWeights) -> AdminReply:
        """Receives the whole broadcast (so the trainer is never left waiting), then checks it on the meta
        copy; kept for load_received. On this worker's step thread, between two steps."""
        self._received = None
        group = self.sync_groups.get(update.group_name)
        if group is None:
            return AdminReply(error=f"weight update group {update.group_name!r} does not exist: "
                                    "init_weights_update_group first")

        def receive() -> str:
            named = group.receive(update)
            self.weights.check_tensors(named)
            self._received = named
            return f"Received {len(named)} tensors."

        return _weight_reply(receive)

    def load_received(self, _: object = None) -> AdminReply:
        named, self._received = self._received, None
        if named is None:
            return AdminReply(error="no received weights to load")
        return _weight_reply(lambda: self.weights.from_tensors(named, checked=True))

    def drop_received(self, _: object = None) -> AdminReply:
        self._received = None
        return AdminReply()

    def update_weights_from_distributed(self, update: DistributedWeights) -> AdminReply:
        reply = self.receive_weights(update)
        return reply if reply.error is not None else self.load_received()

    def memory_sleep(self, ctl: SleepControl) -> AdminReply:
        """Gives this rank's weights / KV cache back or takes them again (ctl.sleep); between two steps with
        nothing running. The reply's sleeping_tags: what stays released."""
        return self.memory.apply(ctl)

    def add_lora(self, load: LoraLoad) -> None:
        """An adapter loaded at run time, read and checked on this rank (any thread; InvalidRequestError naming
        what is wrong) before the scheduler lets any request name it (runtime/lora/lora_registry.py)."""
        if self.runner.lora is None:
            raise InvalidRequestError("LoRA is not enabled: start the server with --enable-lora", param="lora_name")
        self.runner.lora.add(load)

    def _drop_loras(self, batch: WorkerBatch) -> None:
        if batch.lora_drops:  # unloaded adapters whose last request finished: their weights go
            self.runner.lora.drop(batch.lora_drops)

    def run_batch(self, batch: WorkerBatch) -> BatchResult:
        self._drop_loras(batch)
        result = self.runner.run_batch(batch)
        if self.profiler is not None:
            self._profiled()
        return result

    def release(self) -> None:
        for name in [n for n, g in self.sync_groups.items() if g is not None]:  # their sockets go too
            self.destroy_weights_update_group(name)
        self.runner.release()

    def launch_batch(self, batch: WorkerBatch, sample_later: bool = False, keep_on_device: bool = False) -> LaunchedBatch:
        self._drop_loras(batch)
        launched = self.runner.launch_batch(batch, sample_later, keep_on_device)
        if self.profiler is not None:
            self._profiled()
        return launched

    def sample_deferred(self, launched: LaunchedBatch, grammar_rows: list[int], grammar_mask: bytes) -> LaunchedBatch:
        return self.runner.sample_deferred(launched, grammar_rows, grammar_mask)

    def finish_batch(self, launched: LaunchedBatch) -> BatchResult:
        return self.runner.finish_batch(launched)


def _weight_reply(update) -> AdminReply:
    """A weight update's outcome as a typed reply: the message, or the error naming the problem."""
    try:
        return AdminReply(message=update())
    except WeightLoadError as e:
        return AdminReply(error=str(e))
    except Exception as e:  # e.g. a torch error of a loader: still the caller's update, not this worker's step
        logger.exception("weight update failed")
        return AdminReply(error=f"{type(e).__name__}: {e}")
