"""Qwen2: the Llama decoder with bias on the q/k/v projections (ModelConfig.attention_bias)."""

from runtime.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
