"""LoraManager: a worker's adapters. Reads every --lora-modules adapter at start, and those loaded at run
time (add(); drop() once unloaded and unused), into host memory, and attaches a LoraDelta with --max-loras
slots of rank --max-lora-rank to every projection, 16-bit or quantized (FP8, 4-bit: runtime/lora/lora_attach.py).
The scheduler decides which adapter occupies which slot (runtime/lora/lora_slots.py): load_slots() copies
them in before the step that first uses them. The model runner calls prepare() with the step's per-token
slots before the forward. Where an FP8 KV rotation's V side lives in W_v / W_o, each adapter's v_proj B and
o_proj A are folded the same way as it is read (runtime/model_executor/v_rotation_fold.py); with an FP8 KV
cache an adapter whose K/V terms outgrow the calibrated scales is refused as it is read
(runtime/model_executor/kv_range_probe.py)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from runtime.config import ServerArgs
from runtime.errors import ServerArgsError
from runtime.lora.lora_adapter import LoraAdapter, LoraWeights
from runtime.lora.lora_attach import attach_lora, logical_shape
from runtime.lora.lora_batch import LoraBatch
from runtime.lora.lora_config import FLAG, LoraAdapterConfig, LoraSpec, load_error, parse_lora_modules
from runtime.lora.lora_layer import LoraDelta
from runtime.messages import LoraLoad
from runtime.model_executor.kv_range_probe import probe_of
from runtime.model_executor.v_rotation_fold import fold_lora_pair, folded_v_mat

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
        self.args = args
        self.num_layers = len(layers := _decoder_layers(model))
        # An FP8 KV rotation folded into W_v / W_o (before this: kv_cache_format.py) folds into the adapters too;
        # its H on the host now, so a load at run time (another thread) reads no device memory
        self.v_folds = [None if (h := folded_v_mat(layer.self_attn)) is None else h.float().cpu() for layer in layers]
        self.kv_probe = probe_of(model)  # with an FP8 KV cache: each adapter's K/V range is checked as it is read
        # the activations' dtype (the embedding is never quantized): the adapters run on the 16-bit x
        embed = model.model.embed_tokens.weight
        self.batch = LoraBatch(args.max_loras, embed.dtype, embed.device)
        # Sized for any adapter a load at run time may bring (rank up to --max-lora-rank, any projection), as
        # vLLM sizes them: the buffers never change shape, so CUDA graphs captured at start stay valid.
        targets = sorted({fused for fused, _, _ in _FUSED.values()})
        self.deltas: list[dict[str, LoraDelta]] = []
        for layer in layers:
            per_layer = {}
            for fused in targets:
                module = layer.get_submodule(fused)
                per_layer[fused] = LoraDelta(module, self.batch, _SUBS.get(fused, 1), args.max_loras,
                                             args.max_lora_rank, fused in _ROW_PARALLEL, logical_shape(module))
                attach_lora(module, per_layer[fused])
            self.deltas.append(per_layer)
        # adapter id → its weights in host memory; start-up's are 1.. in --lora-modules order (LoraRegistry)
        self.adapters: dict[int, LoraAdapter] = {}
        for i, spec in enumerate(parse_lora_modules(args.lora_modules), 1):
            self.adapters[i] = self._read(spec)  # each checked against the model now, not mid-serving
        logger.info("LoRA: %d adapter(s) (%s), %d slots, rank %d", len(self.adapters),
                    ", ".join(a.config.name for a in self.adapters.values()), args.max_loras, args.max_lora_rank)

    def _read(self, spec: LoraSpec) -> LoraAdapter:
        """The adapter read and checked against the model's projections (ServerArgsError naming the flag)."""
        config = LoraAdapterConfig.read(spec, self.args.max_lora_rank)
        try:
            adapter = LoraAdapter.load(config, self.num_layers)
        except ServerArgsError:
            raise
        except Exception as e:  # unreadable, or not a safetensors file (safetensors' own error type)
            raise ServerArgsError(FLAG, f"adapter {spec.name!r} ({spec.path}): adapter_model.safetensors: "
                                        f"{type(e).__name__}: {e}") from None
        for (layer, module), w in adapter.weights.items():
            fused, _, shard_id = _FUSED[module]
            try:
                self.deltas[layer][fused].shard(shard_id, w.a, w.b)
            except (ValueError, RuntimeError) as e:  # a shape the base model's projection does not have
                raise ServerArgsError(FLAG, f"adapter {spec.name!r}: layer {layer} {module}: {e}") from None
        for (layer, module), w in list(adapter.weights.items()):  # shapes checked above: heads view cleanly
            if (h := self.v_folds[layer]) is not None and module in ("v_proj", "o_proj"):
                adapter.weights[layer, module] = LoraWeights(*fold_lora_pair(module, w.a, w.b, h))
        if self.kv_probe is not None:  # an FP8 KV cache: its K/V terms must fit the calibrated scales
            self._check_kv_range(spec, adapter)
        return adapter

    def _check_kv_range(self, spec: LoraSpec, adapter: LoraAdapter) -> None:
        """ServerArgsError naming the adapter, the layer and the ratio where its k_proj / v_proj terms take
        K or V past the FP8 KV cache's range (runtime/model_executor/kv_range_probe.py)."""
        terms: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), w in adapter.weights.items():
            if module in ("k_proj", "v_proj"):  # this rank's rows of B, placed as the fused qkv output's
                delta = self.deltas[layer]["self_attn.qkv_proj"]
                terms.setdefault(layer, []).append(delta.shard(_FUSED[module][2], w.a, w.b))
        why = self.kv_probe.check(f"adapter {spec.name!r} ({spec.path})", terms) if terms else None
        if why is not None:
            raise ServerArgsError(FLAG, why)

    def add(self, load: LoraLoad) -> None:
        """An adapter loaded at run time (any thread: reads host files, writes no device memory); an
        InvalidRequestError naming lora_path if it cannot be served. Its id is not in any batch before this returns."""
        try:
            self.adapters[load.lora_id] = self._read(LoraSpec(load.name, load.path))
        except ServerArgsError as e:
            raise load_error(e) from None
        logger.info("LoRA: adapter %r loaded from %s (id %d)", load.name, load.path, load.lora_id)

    def drop(self, lora_ids: list[int]) -> None:
        """Forgets unloaded adapters (no request uses them: LoraRegistry); their slots are simply reused."""
        for lora_id in lora_ids:
            self.adapters.pop(lora_id, None)

    def load_slots(self, loads: list[list[int]]) -> None:
        """[slot, adapter id] pairs: each slot's previous adapter (no request uses it now) is replaced."""
        for slot, adapter_id in loads:
            self._clear(slot)
            adapter = self.adapters[adapter_id]
            for (layer, module), w in adapter.weights.items():
                fused, sub, shard_id = _FUSED[module]
                self.deltas[layer][fused].load(slot, sub, shard_id, w.a, w.b)

    def _clear(self, slot: int) -> None:
        for per_layer in self.deltas:
            for delta in per_layer.values():
                delta.clear(slot)

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
    return layers
