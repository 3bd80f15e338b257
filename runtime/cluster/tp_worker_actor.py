"""TpWorkerActor: one TP rank of a replica as a Ray actor — a thin host around runtime's TpWorker.

Rank 0 picks the rendezvous address (its node's IP and a free port); every rank then joins one
torch.distributed group (NCCL on GPU, gloo on CPU) and builds its TpWorker on it. Each step every rank
gets the same msgpack-encoded WorkerBatch; the TP collectives keep their logits identical and the
sampler is deterministic given the logits, so only rank 0 sends its BatchResult back."""

from __future__ import annotations

import datetime
import functools
import os
import socket
from collections.abc import Callable

import msgspec

from runtime.config import ServerArgs
from runtime.messages import BatchResult, WorkerBatch, WorkerInfo

# A dead peer must surface as an error well before torch's 30-minute default; the WorkerGroup notices
# a dead actor at once anyway, this only bounds a rank left blocked inside a collective.
COLLECTIVE_TIMEOUT_S = 120


class TpWorkerActor:
    def __init__(self, args: ServerArgs, model_path: str, rank: int, world_size: int, dp_attention: bool = False):
        self.args, self.model_path = args, model_path
        self.rank, self.world_size, self.dp_attention = rank, world_size, dp_attention
        self.worker = None
        self._set_device: Callable[[], None] | None = None  # re-selects this actor's GPU (per thread)
        self._decoder = msgspec.msgpack.Decoder(WorkerBatch)
        self._encoder = msgspec.msgpack.Encoder()

    def endpoint(self) -> tuple[str, int]:
        """Rank 0's rendezvous address: this node's IP and a port free on it right now."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def init(self, master_addr: str, master_port: int) -> WorkerInfo:
        """Joins the replica's process group (every rank must call this concurrently) and loads the model."""
        import torch

        from runtime.distributed import ParallelGroup
        from runtime.model_executor.tp_worker import TpWorker
        from runtime.models.parallel_context import ParallelContext

        device = self._device()
        if device.type == "cpu":
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        group = ParallelGroup.single()
        if self.world_size > 1:
            import torch.distributed as dist

            if device.type == "cpu" and master_addr.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
                os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # a one-machine cluster: keep gloo on loopback
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                    world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            group = ParallelGroup(self.rank, self.world_size, dist.group.WORLD)
        if self.dp_attention:
            ctx = ParallelContext(attn=ParallelGroup.single(), mlp=group, dp_attention=True)
        else:
            ctx = ParallelContext.tensor_parallel(group)
        self.worker = TpWorker(self.args, self.model_path, ctx, device)
        return self.worker.info()

    def _device(self):
        import ray
        import torch

        ids = ray.get_gpu_ids()
        if self.args.device != "cpu" and ids:
            # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU, unless RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
            # is set: then every GPU is visible and the assigned one is found by its id.
            index = local_gpu_index(str(ids[0]), os.environ.get("CUDA_VISIBLE_DEVICES"))
            torch.cuda.set_device(index)
            self._set_device = functools.partial(torch.cuda.set_device, index)
            return torch.device("cuda", index)
        return torch.device("cpu")

    def run_batch(self, data: bytes) -> bytes:
        """data: a msgpack WorkerBatch. Returns rank 0's msgpack BatchResult; other ranks return b""."""
        if self._set_device is not None:
            self._set_device()  # the current CUDA device is per thread; a compiled graph calls from its own
        result: BatchResult = self.worker.run_batch(self._decoder.decode(data))
        # DP attention: every rank serves its own scheduler, so every rank answers.
        return self._encoder.encode(result) if self.rank == 0 or self.dp_attention else b""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def ping(self) -> bool:
        return self.worker is not None

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def local_gpu_index(gpu_id: str, visible: str | None) -> int:
    """This process's CUDA index of Ray's GPU id: its place in CUDA_VISIBLE_DEVICES, or the id itself."""
    if not visible:
        return int(gpu_id)
    ids = [v.strip() for v in visible.split(",")]
    if gpu_id not in ids:
        raise RuntimeError(f"Ray assigned GPU {gpu_id}, which CUDA_VISIBLE_DEVICES={visible!r} does not list")
    return ids.index(gpu_id)
