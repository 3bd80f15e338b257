"""Name → backend class, imported lazily so CPU installs never import flashinfer."""

from __future__ import annotations

import importlib
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
    if name != "auto":
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


def create_attention_backend(name: str, spec: AttentionSpec) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(ATTENTION_BACKENDS)}")
    module, cls = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(spec)
