"""create_engine_client: the one place that chooses between the in-process Engine and the Ray actors.

`shoal serve` runs the card's shape — scheduler and TP workers as Ray actors, the gateway in front — on a
GPU machine, and everything in one process on a CPU (where Ray's processes would only compete for the
few cores). --use-ray / --in-process override; TP, DP and --address always mean Ray."""

from __future__ import annotations

from runtime.config import ServerArgs
from runtime.engine_client import EngineClient


def runs_in_process(args: ServerArgs) -> bool:
    """True when the scheduler and the worker share this process (runtime.engine.Engine)."""
    if args.uses_ray:
        return False
    return args.in_process or not _gpu_wanted(args.device)


def _gpu_wanted(device: str) -> bool:
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def create_engine_client(args: ServerArgs, accelerator_type: str | None = None) -> EngineClient:
    """Builds (and loads) what the gateway serves through; the caller shuts it down.
    accelerator_type (a Serve replica's): every bundle of every replica group asks for a node with that
    accelerator, as Ray Serve LLM's bundles do; in process, the engine runs where its caller was placed."""
    if runs_in_process(args):
        from runtime.engine import Engine

        return Engine(server_args=args)
    from runtime.cluster import placement
    from runtime.cluster.launch import create_ray_engine_client

    if accelerator_type is None:
        return create_ray_engine_client(args)
    groups = 1 if args.enable_dp_attention else args.dp_size  # ReplicaLauncher's: one placement group each
    return create_ray_engine_client(args, replica_resources=[placement.accelerator_resource(accelerator_type)
                                                             for _ in range(groups)])
