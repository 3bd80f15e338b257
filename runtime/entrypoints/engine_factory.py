"""create_engine_client: the one place that chooses between the in-process Engine and the Ray actors."""

from __future__ import annotations

from runtime.config import ServerArgs
from runtime.engine_client import EngineClient


def runs_in_process(args: ServerArgs) -> bool:
    """True when the scheduler and the worker share this process (runtime.engine.Engine)."""
    return not args.uses_ray


def create_engine_client(args: ServerArgs) -> EngineClient:
    """Builds (and loads) what the gateway serves through; the caller shuts it down."""
    if runs_in_process(args):
        from runtime.engine import Engine

        return Engine(server_args=args)
    from runtime.cluster.launch import create_ray_engine_client

    return create_ray_engine_client(args)
