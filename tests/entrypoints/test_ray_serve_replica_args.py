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


def test_build_app_takes_a_list_of_origins_and_names_args_serve_ignores(caplog):
    """serve_config.yaml's args as a vLLM user writes them: allowed_origins as a YAML list works (it was
    refused as "must be a str"); host / port / shutdown_timeout_s, which Serve's proxy and graceful
    shutdown own, are said to have no effect instead of being dropped silently."""
    import logging

    from runtime.entrypoints.ray_serve import build_app

    with caplog.at_level(logging.WARNING, logger="runtime.entrypoints.ray_serve"):
        app = build_app({"model_path": "/models/m", "allowed_origins": ["http://a.com", "http://b.com"],
                         "metrics_compat": ["vllm"], "port": 9000})
    assert app is not None
    assert "args.port has no effect under Ray Serve" in caplog.text and "allowed_origins" not in caplog.text


def test_vllm_api_key_keys_a_replica_unless_args_name_one(monkeypatch):
    """$VLLM_API_KEY in a replica's runtime_env keys it, as `shoal serve` and vLLM take it: the replica ran
    open before. An api_key in args wins; an empty variable is none; a key no header could carry is refused
    naming the variable."""
    from runtime.errors import ServerArgsError

    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert replica_args({"model_path": "/models/m"}).api_key == ("env-key",)
    assert replica_args({"model_path": "/models/m", "api_key": None}).api_key == ("env-key",)
    assert replica_args({"model_path": "/models/m", "api_key": "flag-key"}).api_key == ("flag-key",)
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert replica_args({"model_path": "/models/m"}).api_key is None
    monkeypatch.setenv("VLLM_API_KEY", " spaced ")
    with pytest.raises(ServerArgsError, match="whitespace") as e:
        replica_args({"model_path": "/models/m"})
    assert e.value.flag == "$VLLM_API_KEY"
