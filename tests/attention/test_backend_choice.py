"""--attention-backend names a backend that cannot run here: one ServerArgsError at start-up naming the flag
(before: triton on a CPU engine started and then failed every request; flashinfer without the package was
a ModuleNotFoundError traceback)."""

from __future__ import annotations

import pytest
import torch

from runtime.attention.registry import resolve_backend_name
from runtime.errors import ServerArgsError

CPU = torch.device("cpu")


def test_triton_on_cpu_only_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel tests' mode
    assert resolve_backend_name("triton", CPU) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ServerArgsError, match="triton runs on CUDA GPUs and this engine runs on cpu") as info:
        resolve_backend_name("triton", CPU)
    assert info.value.flag == "--attention-backend"


def test_flashinfer_and_unknown_names_refused_on_cpu():
    with pytest.raises(ServerArgsError, match="flashinfer runs on CUDA GPUs"):
        resolve_backend_name("flashinfer", CPU)
    with pytest.raises(ServerArgsError, match="unknown backend 'flash'"):
        resolve_backend_name("flash", CPU)
    assert resolve_backend_name("torch_native", CPU) == "torch_native"
    assert resolve_backend_name("auto", CPU) == "torch_native"


def test_engine_refuses_at_start(tiny_llama):
    from runtime import Engine

    with pytest.raises(ServerArgsError, match="--attention-backend"):
        Engine(str(tiny_llama), device="cpu", attention_backend="flashinfer", max_total_tokens=1024)
