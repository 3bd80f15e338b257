"""CheckpointKVScales: the per-layer FP8 KV scales an FP8 checkpoint ships, read from its safetensors.

Layouts (the names vLLM's loader accepts): `model.layers.N.self_attn.k_scale` / `v_scale` (compressed-tensors
with a kv_cache_scheme, llm-compressor), `...self_attn.attn.k_scale` / `v_scale`, `...self_attn.kv_scale`
(one scale for both), and `...self_attn.k_proj.output_scale` / `v_proj.output_scale` (AutoFP8). A scale is
a scalar; a per-head vector is reduced to its max (every head then fits; our kernels take one float per
layer). Only the scale tensors are read, not the weights."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch

from runtime.errors import WeightLoadError
from runtime.mem_cache.kv_scales import KVScales
from runtime.model_executor.weight_loader import safetensors_files

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale|kv_scale|"
                   r"k_proj\.output_scale|v_proj\.output_scale)$")
_WHICH = {"k_scale": "k", "v_scale": "v", "kv_scale": "kv", "k_proj.output_scale": "k",
          "v_proj.output_scale": "v"}


class CheckpointKVScales:
    @staticmethod
    def read(model_path: str | Path, num_layers: int, num_kv_heads: int) -> KVScales | None:
        """The checkpoint's scales, None when it has none; WeightLoadError naming the tensor when they are
        malformed (not a positive finite scalar or per-head vector, a layer past the model's, or given
        for some layers only)."""
        from safetensors import safe_open

        k: dict[int, float] = {}
        v: dict[int, float] = {}
        for f in safetensors_files(model_path):
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    m = _NAME.match(name)
                    if m is None:
                        continue
                    layer, which = int(m.group(1)), _WHICH[m.group(2)]
                    if layer >= num_layers:
                        raise WeightLoadError(f"KV scale {name} in {f.name} is for layer {layer}, but the model "
                                              f"has {num_layers} layers")
                    value = _scale_value(name, handle.get_tensor(name), num_kv_heads)
                    if "k" in which:
                        k[layer] = value
                    if "v" in which:
                        v[layer] = value
        if not k and not v:
            return None
        missing = [f"layer {i} {kind}" for i in range(num_layers) for kind, got in (("k_scale", k), ("v_scale", v))
                   if i not in got]
        if missing:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            raise WeightLoadError(f"checkpoint {model_path} has KV cache scales for some layers but not for "
                                  f"{shown}; use --kv-cache-scale-mode calibrate to ignore them")
        return KVScales(tuple(k[i] for i in range(num_layers)), tuple(v[i] for i in range(num_layers)),
                        "checkpoint")


def _scale_value(name: str, tensor: torch.Tensor, num_kv_heads: int) -> float:
    if tensor.numel() not in (1, num_kv_heads):
        raise WeightLoadError(f"KV scale {name} has shape {tuple(tensor.shape)}: expected a scalar or one "
                              f"value per KV head ({num_kv_heads})")
    value = float(tensor.float().max())
    if not (math.isfinite(value) and value > 0) or not bool((tensor.float() > 0).all()):
        raise WeightLoadError(f"KV scale {name} must be positive and finite, got {tensor.flatten().tolist()}")
    return value
