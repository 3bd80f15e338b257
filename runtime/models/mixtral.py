"""Mixtral: the Mistral decoder with 8 routed experts per layer (top 2, weights always renormalized)."""

from runtime.layers.fused_moe import DOWN, GATE, UP
from runtime.models.moe_causal_lm import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    expert_parts = {"w1": GATE, "w3": UP, "w2": DOWN}
    module_renames = (("block_sparse_moe", "mlp"),)
