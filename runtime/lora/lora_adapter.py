"""LoraAdapter: one PEFT adapter's A/B matrices read from adapter_model.safetensors, keyed by (layer,
projection), B already multiplied by the adapter's scaling (so the batched compute needs no scale table)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from runtime.errors import ServerArgsError
from runtime.lora.lora_config import FLAG, SUPPORTED_MODULES, LoraAdapterConfig

# PEFT's saved names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (".default" when
# saved from a live PeftModel's state_dict).
_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                     r"\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True, slots=True)
class LoraWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], scaled


@dataclass(slots=True)
class LoraAdapter:
    config: LoraAdapterConfig
    weights: dict[tuple[int, str], LoraWeights]  # (layer, q_proj / ... / down_proj) → its pair

    @classmethod
    def load(cls, config: LoraAdapterConfig, num_layers: int) -> LoraAdapter:
        where = f"adapter {config.name!r} ({config.path})"
        tensors = load_file(str(config.path / "adapter_model.safetensors"))
        halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            m = _TENSOR.match(name)
            if m is None:
                why = ("embedding / lm_head LoRA is not supported" if "embed" in name or "lm_head" in name
                       else "DoRA is not supported" if "magnitude" in name else "not a LoRA weight Shoal serves")
                raise ServerArgsError(FLAG, f"{where}: tensor {name}: {why}")
            layer, module, half = int(m.group(1)), m.group(2), m.group(3)
            if module not in SUPPORTED_MODULES:
                raise ServerArgsError(FLAG, f"{where}: tensor {name}: LoRA on {module} is not supported")
            if layer >= num_layers:
                raise ServerArgsError(FLAG, f"{where}: tensor {name}: the model has {num_layers} layers")
            halves.setdefault((layer, module), {})[half] = t
        weights = {}
        for key, pair in halves.items():
            if set(pair) != {"A", "B"}:
                raise ServerArgsError(FLAG, f"{where}: layer {key[0]} {key[1]} has lora_{''.join(pair)} only")
            a, b = pair["A"], pair["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.rank or b.shape[1] != config.rank:
                raise ServerArgsError(FLAG, f"{where}: layer {key[0]} {key[1]}: lora_A {tuple(a.shape)} and "
                                            f"lora_B {tuple(b.shape)} do not match r = {config.rank}")
            weights[key] = LoraWeights(a.float(), b.float() * config.scaling)
        if not weights:
            raise ServerArgsError(FLAG, f"{where}: adapter_model.safetensors holds no LoRA weights")
        return cls(config, weights)

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.weights}
