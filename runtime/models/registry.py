"""Architecture name (config.json `architectures`) → model class, imported lazily."""

from __future__ import annotations

import importlib
from types import MappingProxyType

from torch import nn

from runtime.errors import ModelConfigError

MODEL_REGISTRY = MappingProxyType({
    "LlamaForCausalLM": "runtime.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "runtime.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "runtime.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "runtime.models.qwen3:Qwen3ForCausalLM",
})


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ModelConfigError(f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}")
    module, cls = MODEL_REGISTRY[architecture].split(":")
    return getattr(importlib.import_module(module), cls)
