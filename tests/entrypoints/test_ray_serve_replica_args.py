"""A Ray Serve replica with tp = dp = 1 runs the Engine inside itself on a GPU machine too (it holds the GPU
its ray_actor_options ask for), as deploy/README.md says; shoal serve on a GPU would start actors instead."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from runtime.entrypoints.engine_factory import runs_in_process  # noqa: E402
from runtime.entrypoints.ray_serve import replica_args  # noqa: E402


def test_one_gpu_replica_stays_in_process(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as seen by the factory
    args = replica_args({"model_path": "/models/m", "device": "cuda"})
    assert args.in_process and runs_in_process(args)
    for parallel in ({"tp_size": 2}, {"dp_size": 2}, {"use_ray": True}):  # those still mean Ray actors
        args = replica_args({"model_path": "/models/m", "device": "cuda", **parallel})
        assert not args.in_process and not runs_in_process(args)
