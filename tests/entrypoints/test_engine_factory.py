"""The engine factory's choice: in-process on CPU, Ray actors on a GPU, flags and TP/DP override."""

from __future__ import annotations

import pytest

from runtime.config import ServerArgs
from runtime.entrypoints.engine_factory import runs_in_process
from runtime.errors import ServerArgsError


@pytest.mark.parametrize(("kw", "in_process"), [
    ({"device": "cpu"}, True),
    ({"device": "cuda"}, False),  # the card's shape is the GPU default
    ({"device": "cuda", "in_process": True}, True),
    ({"device": "cpu", "use_ray": True}, False),
    ({"device": "cpu", "tp_size": 2}, False),
    ({"device": "cpu", "dp_size": 2}, False),
    ({"device": "cpu", "address": "auto"}, False),
])
def test_choice(kw, in_process):
    assert runs_in_process(ServerArgs(**kw)) is in_process


def test_auto_device_follows_the_machine(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runs_in_process(ServerArgs(device="auto"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not runs_in_process(ServerArgs(device="auto"))


def test_in_process_with_ray_settings_is_refused():
    with pytest.raises(ServerArgsError, match="--in-process"):
        ServerArgs(in_process=True, tp_size=2)
