"""MoeForCausalLM: the Llama decoder with a SparseMoeBlock as the MLP of its sparse layers.

Which layers are sparse is ModelConfig.is_sparse_layer (HF's decoder_sparse_step / mlp_only_layers; the
others keep the dense LlamaMLP of intermediate_size, fused decode paths included). Checkpoints name every
expert's tensors apart (experts.{e}.gate_proj.weight, ...); they load into FusedMoE's per-layer stacks."""

from __future__ import annotations

import re

from torch import nn

from runtime.layers.fused_moe import DOWN, GATE, UP
from runtime.model_config import ModelConfig
from runtime.models.llama import LlamaForCausalLM, LlamaMLP
from runtime.models.moe_block import SparseMoeBlock
from runtime.models.parallel_context import ParallelContext

# an expert's weight, or an FP8 checkpoint's scales of it (input_scale: static activation scales, unused)
_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.(weight|weight_scale|weight_scale_inv|input_scale)$")
_STACKS = {"w13_weight": (GATE, UP), "w2_weight": (DOWN,), "w13_weight_scale": (GATE, UP),
           "w2_weight_scale": (DOWN,)}


def moe_mlp(cfg: ModelConfig, layer_id: int, ctx: ParallelContext) -> nn.Module:
    return SparseMoeBlock(cfg, ctx) if cfg.is_sparse_layer(layer_id) else LlamaMLP(cfg, ctx)


class MoeForCausalLM(LlamaForCausalLM):
    make_mlp = staticmethod(moe_mlp)
    # checkpoint expert tensor → FusedMoE part (Qwen's names; Mixtral overrides)
    expert_parts = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}
    # checkpoint module name → ours (Mixtral's block_sparse_moe is our decoder layer's mlp)
    module_renames: tuple[tuple[str, str], ...] = ()

    def _checkpoint_target(self, name: str) -> tuple[str, object]:
        for hf, ours in self.module_renames:
            name = name.replace(f".{hf}.", f".{ours}.")
        m = _EXPERT.search(name)
        if m is None:
            return super()._checkpoint_target(name)
        part = self.expert_parts.get(m.group(2))
        if part is None or m.group(3) == "input_scale":
            return name, None  # not a tensor we use: skipped (the missing check names what we lack)
        stack = ("w2_weight" if part == DOWN else "w13_weight") + ("" if m.group(3) == "weight" else "_scale")
        return f"{name[:m.start()]}.experts.{stack}", (int(m.group(1)), part)

    def _missing_tensors(self, param: str, loaded: set[str]) -> list[str]:
        prefix, _, stack = param.rpartition(".experts.")
        if stack not in _STACKS:
            return [self._hf_module_name(n) for n in super()._missing_tensors(param, loaded)]
        parts = {v: k for k, v in self.expert_parts.items()}
        experts = self.cfg.moe.num_experts if self.cfg.moe is not None else 0
        suffix = self.get_submodule(f"{prefix}.experts").scale_name if stack.endswith("_scale") else "weight"
        return [self._hf_module_name(f"{prefix}.experts.{e}.{parts[p]}.{suffix}")
                for e in range(experts) for p in _STACKS[stack] if f"{param}:{(e, p)}" not in loaded]

    def _hf_module_name(self, name: str) -> str:
        for hf, ours in self.module_renames:
            name = name.replace(f".{ours}.", f".{hf}.")
        return name
