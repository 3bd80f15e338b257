"""Name → backend class, imported lazily so CPU installs never import flashinfer."""

from __future__ import annotations

import importlib
import os
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.attention.base import AttentionBackend
    from runtime.attention.spec import AttentionSpec

ATTENTION_BACKENDS = MappingProxyType({
    "torch_native": "runtime.attention.torch_native:TorchNativeAttnBackend",
    "triton": "runtime.attention.triton_backend:TritonAttnBackend",
    "flashinfer": "runtime.attention.flashinfer_backend:FlashInferAttnBackend",
})


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                         sliding_window: bool = False, head_dim: int = 128) -> str:
    """auto's pick for the device, or the named backend once it is known to run here (ServerArgsError
    naming --attention-backend if not: at start-up, not as a failure of every request)."""
    if name != "auto":
        _check_runs_here(name, device)
        return name
    if device.type != "cuda":
        return "torch_native"
    if dtype == torch.float32:  # flashinfer kernels take fp16/bf16 only
        return "triton"
    if sliding_window:  # our flashinfer wrapper plans full attention only
        return "triton"
    if head_dim not in (64, 128, 256):  # flashinfer_backend.FLASHINFER_HEAD_DIMS (kept import-free here)
        return "triton"
    try:
        importlib.import_module("flashinfer")
        return "flashinfer"
    except ImportError:
        return "triton"


def _check_runs_here(name: str, device: torch.device) -> None:
    from runtime.errors import ServerArgsError

    if name not in ATTENTION_BACKENDS:
        raise ServerArgsError("--attention-backend", f"unknown backend {name!r}; known: auto, "
                                                     f"{', '.join(ATTENTION_BACKENDS)}")
    # Triton kernels run on CPU only in the interpreter (the kernel tests); flashinfer never does.
    on_gpu = device.type == "cuda" or (name == "triton" and os.environ.get("TRITON_INTERPRET") == "1")
    if name != "torch_native" and not on_gpu:
        raise ServerArgsError("--attention-backend", f"{name} runs on CUDA GPUs and this engine runs on "
                                                     f"{device.type}: use auto or torch_native")
    if name == "flashinfer":
        try:
            importlib.import_module("flashinfer")
        except ImportError as e:
            raise ServerArgsError("--attention-backend", f"flashinfer is not installed ({e}): install it "
                                                         "(pip install flashinfer-python) or use auto or triton") from None


def create_attention_backend(name: str, spec: AttentionSpec) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(ATTENTION_BACKENDS)}")
    module, cls = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(spec)
