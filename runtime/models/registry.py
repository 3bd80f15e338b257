"""Architecture name (config.json `architectures`) → model class, imported lazily."""

from __future__ import annotations

import importlib
from types import MappingProxyType

from torch import nn

from runtime.errors import ModelConfigError
from runtime.model_config import SUPPORTED_ARCHITECTURES

MODEL_REGISTRY = MappingProxyType({name: path for name, (_type, path) in SUPPORTED_ARCHITECTURES.items()})


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ModelConfigError(f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}")
    module, cls = MODEL_REGISTRY[architecture].split(":")
    return getattr(importlib.import_module(module), cls)
