"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's decoder (q/k/v bias), routed experts plus a shared
expert gated by sigmoid(shared_expert_gate); decoder_sparse_step / mlp_only_layers keep some layers dense."""

from runtime.models.moe_causal_lm import MoeForCausalLM


class Qwen2MoeForCausalLM(MoeForCausalLM):
    pass
