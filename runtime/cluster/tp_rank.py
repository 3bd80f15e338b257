"""TpRank: what one TP rank's process holds under Ray — its torch.distributed group, its TpWorker and,
for a TP group with one scheduler, the StepChannel that carries each step from rank 0 to the others.
Rank 0 (a SchedulerActor) and the other ranks (TpWorkerActors) are set up by the same code here.

Rank 0 picks the rendezvous address (its node's IP and a free port); every rank joins one
torch.distributed group (NCCL on GPU, gloo on CPU) concurrently and loads its shard of the model."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from runtime.config import ServerArgs
from runtime.distributed.step_channel import StepChannel, create_step_channel
from runtime.errors import ServerArgsError
from runtime.model_executor.tp_worker import TpWorker

# A dead peer must surface as an error well before torch's 30-minute default; the scheduler actor notices
# a dead rank at once anyway, this only bounds a rank left blocked inside a collective.
COLLECTIVE_TIMEOUT_S = 120


def local_model_path(args: ServerArgs, model_path: str) -> str:
    """The folder this rank loads. The launcher resolved the embedded default model (no --model-path), or a
    Hub repo id's snapshot, in its own node's cache, which another node may lack or keep elsewhere: there each
    rank finds it in its node's cache (the default model's build is file-locked, so a node's ranks share one),
    at the commit the launcher loaded (.../snapshots/<commit>), never at whatever that node's refs/main
    names now: a rank whose node lacks the commit fails, naming it, rather than loading other weights."""
    if args.model_path is not None:
        from runtime.hf_cache import HfCache, looks_like_repo_id, snapshot_commit

        if Path(model_path).exists() or not looks_like_repo_id(args.model_path):
            return model_path
        commit = snapshot_commit(model_path)
        if commit is None:  # not a cache snapshot (a caller's own path): the revision asked for
            return str(HfCache.from_env().resolve(args.model_path, args.revision, "--model-path"))
        try:
            return str(HfCache.from_env().resolve(args.model_path, commit, "--model-path"))
        except ServerArgsError as e:
            raise ServerArgsError("--model-path", f"the launcher loaded {args.model_path!r} at commit {commit}"
                                                  f"{_asked(args.revision)}, which the Hugging Face cache of "
                                                  f"node {socket.gethostname()} lacks: {e.detail}") from None
    from runtime.default_model import ensure_default_model

    return str(ensure_default_model())


def _asked(revision: str | None) -> str:
    return f" (--revision {revision})" if revision else " (refs/main on its node)"


@dataclass(frozen=True, slots=True)
class RankSpec:
    rank: int
    world_size: int
    dp_attention: bool = False  # every rank runs its own scheduler; only the MLP spans the group

    @property
    def has_step_channel(self) -> bool:
        return self.world_size > 1 and not self.dp_attention


@dataclass(slots=True)
class TpRank:
    spec: RankSpec
    worker: TpWorker
    channel: StepChannel | None

    @classmethod
    def join(cls, args: ServerArgs, model_path: str, spec: RankSpec, master_addr: str, master_port: int) -> TpRank:
        """Joins the replica's process group (every rank must call this concurrently) and loads the model."""
        import torch

        from runtime.distributed import ParallelGroup
        from runtime.models.parallel_context import ParallelContext

        device = _device(args)
        if device.type == "cpu":
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        group, channel = ParallelGroup.single(), None
        if spec.world_size > 1:
            import torch.distributed as dist

            if device.type == "cpu" and master_addr.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
                os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # a one-machine cluster: keep gloo on loopback
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    init_method=f"tcp://{master_addr}:{master_port}", rank=spec.rank,
                                    world_size=spec.world_size,
                                    timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            group = ParallelGroup(spec.rank, spec.world_size, dist.group.WORLD)
            if spec.has_step_channel:
                # A CPU rank's cores do the model's work: a follower spinning for the next step would take one.
                channel = create_step_channel(spec.rank, spec.world_size, args.step_channel,
                                              spin_s=0.0 if device.type == "cpu" else 0.002)
        if spec.dp_attention:
            ctx = ParallelContext(attn=ParallelGroup.single(), mlp=group, dp_attention=True)
        else:
            ctx = ParallelContext.tensor_parallel(group)
        return cls(spec, TpWorker(args, model_path, ctx, device), channel)


def endpoint() -> tuple[str, int]:
    """A rendezvous address on this node: its IP and a port free on it right now."""
    import ray

    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return ip, s.getsockname()[1]


def _device(args: ServerArgs):
    import ray
    import torch

    ids = ray.get_gpu_ids()
    if args.device != "cpu" and ids:
        # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU, unless RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
        # is set: then every GPU is visible and the assigned one is found by its id.
        index = local_gpu_index(str(ids[0]), os.environ.get("CUDA_VISIBLE_DEVICES"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def local_gpu_index(gpu_id: str, visible: str | None) -> int:
    """This process's CUDA index of Ray's GPU id: its place in CUDA_VISIBLE_DEVICES, or the id itself."""
    if not visible:
        return int(gpu_id)
    ids = [v.strip() for v in visible.split(",")]
    if gpu_id not in ids:
        raise RuntimeError(f"Ray assigned GPU {gpu_id}, which CUDA_VISIBLE_DEVICES={visible!r} does not list")
    return ids.index(gpu_id)
