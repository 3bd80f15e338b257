"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's decoder (q/k RMSNorm) with routed experts only."""

from runtime.models.moe_causal_lm import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass
