"""LoraManager: a worker's adapters. Reads every --lora-modules adapter at start (kept in host memory) and
attaches a LoraDelta with --max-loras slots to each projection any adapter targets. The scheduler decides
which adapter occupies which slot (runtime/lora/lora_slots.py): load_slots() copies them in before the step
that first uses them. The model runner calls prepare() with the step's per-token slots before the forward."""

from __future__ import annotations

import logging

import torch
from torch import nn

from runtime.config import ServerArgs
from runtime.errors import ServerArgsError
from runtime.lora.lora_adapter import LoraAdapter
from runtime.lora.lora_batch import LoraBatch
from runtime.lora.lora_config import FLAG, LoraAdapterConfig, parse_lora_modules
from runtime.lora.lora_layer import LoraDelta

logger = logging.getLogger(__name__)

# PEFT projection → (Shoal's fused module, its sub-projection index, the weight loader's shard id)
_FUSED: dict[str, tuple[str, int, object]] = {
    "q_proj": ("self_attn.qkv_proj", 0, "q"), "k_proj": ("self_attn.qkv_proj", 1, "k"),
    "v_proj": ("self_attn.qkv_proj", 2, "v"), "o_proj": ("self_attn.o_proj", 0, None),
    "gate_proj": ("mlp.gate_up_proj", 0, 0), "up_proj": ("mlp.gate_up_proj", 1, 1),
    "down_proj": ("mlp.down_proj", 0, None),
}
_SUBS = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2}
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


class LoraManager:
    def __init__(self, args: ServerArgs, model: nn.Module):
        specs = parse_lora_modules(args.lora_modules)
        layers = _decoder_layers(model)
        self.names = [s.name for s in specs]
        self.adapters = [LoraAdapter.load(LoraAdapterConfig.read(s, args.max_lora_rank), len(layers))
                         for s in specs]
        weight = layers[0].self_attn.qkv_proj.weight
        max_rank = max((a.config.rank for a in self.adapters), default=1)
        self.batch = LoraBatch(args.max_loras, weight.dtype, weight.device)
        targets = sorted({_FUSED[m][0] for a in self.adapters for m in a.modules})
        self.deltas: list[dict[str, LoraDelta]] = []
        for layer in layers:
            per_layer = {}
            for fused in targets:
                module = layer.get_submodule(fused)
                per_layer[fused] = module.lora = LoraDelta(module, self.batch, _SUBS.get(fused, 1), args.max_loras,
                                                           max_rank, fused in _ROW_PARALLEL)
            self.deltas.append(per_layer)
        # Each adapter's shapes are checked against the model now (a slot filled and emptied), not when a
        # request first loads it mid-serving.
        self.load_slots([[1, i] for i in range(1, len(self.adapters) + 1)])
        self._clear(1)
        logger.info("LoRA: %d adapter(s) (%s), %d slots, rank %d, on %s", len(self.adapters),
                    ", ".join(self.names), args.max_loras, max_rank, ", ".join(targets) or "nothing")

    def load_slots(self, loads: list[list[int]]) -> None:
        """[slot, adapter id (1..)] pairs: each slot's previous adapter (no request uses it now) is replaced."""
        for slot, adapter_id in loads:
            self._clear(slot)
            self._load(slot, self.adapters[adapter_id - 1])

    def _clear(self, slot: int) -> None:
        for per_layer in self.deltas:
            for delta in per_layer.values():
                delta.clear(slot)

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        for (layer, module), w in adapter.weights.items():
            fused, sub, shard_id = _FUSED[module]
            try:
                self.deltas[layer][fused].load(slot, sub, shard_id, w.a, w.b)
            except (ValueError, RuntimeError) as e:  # a shape the base model's projection does not have
                raise ServerArgsError(FLAG, f"adapter {adapter.config.name!r}: layer {layer} {module}: {e}") from None

    def prepare(self, token_slots: torch.Tensor | None, num_tokens: int) -> None:
        """Before a forward: token_slots [T] (None: every token runs the base model)."""
        if token_slots is None:
            self.batch.prepare_base(num_tokens)
        else:
            self.batch.prepare(token_slots)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The dense Llama-family decoder layers LoRA attaches to; anything else is refused by name."""
    from runtime.models.llama import LlamaDecoderLayer, LlamaMLP

    layers = list(getattr(getattr(model, "model", None), "layers", []))
    if not layers or not all(isinstance(layer, LlamaDecoderLayer) for layer in layers):
        raise ServerArgsError("--enable-lora", f"{type(model).__name__} is not supported: LoRA serves dense "
                                               "Llama / Mistral / Qwen2 / Qwen3 models")
    if not all(isinstance(layer.mlp, LlamaMLP) for layer in layers):
        raise ServerArgsError("--enable-lora", "MoE models are not supported")
    if any(p.dtype.itemsize == 1 for p in layers[0].parameters()):
        raise ServerArgsError("--enable-lora", "FP8 / quantized base weights are not supported: serve the "
                                               "16-bit checkpoint without --quantization")
    return layers
