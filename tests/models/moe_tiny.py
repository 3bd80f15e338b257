"""Tiny random MoE checkpoints (Mixtral, Qwen2-MoE with a shared expert and dense layers, Qwen3-MoE) written
with transformers' save_pretrained, so Shoal loads HF's own per-expert tensor names."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import save_random_model

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def make_moe_config(arch: str, vocab_size: int, eos_id: int):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, eos_token_id=eos_id, bos_token_id=eos_id - 1,
                  pad_token_id=0, tie_word_embeddings=False, rope_theta=1000000.0)
    if arch == "mixtral":
        return MixtralConfig(**common, intermediate_size=96, num_hidden_layers=2, num_local_experts=4,
                             num_experts_per_tok=2, sliding_window=None)
    if arch == "qwen2_moe":  # layer 1 sparse (decoder_sparse_step 2); 0, 2 and 3 dense (3: mlp_only_layers)
        return Qwen2MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32,
                              shared_expert_intermediate_size=96, num_experts=6, num_experts_per_tok=2,
                              norm_topk_prob=False, num_hidden_layers=4, decoder_sparse_step=2,
                              mlp_only_layers=[3], use_sliding_window=False)
    if arch == "qwen3_moe":  # layer 1 dense through mlp_only_layers
        return Qwen3MoeConfig(**common, head_dim=32, intermediate_size=128, moe_intermediate_size=48,
                              num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, num_hidden_layers=3,
                              mlp_only_layers=[1])
    raise ValueError(arch)


def make_tiny_moe(arch: str, path: Path, seed: int = 0) -> Path:
    """Writes a random tiny fp32 `arch` checkpoint plus tokenizer into `path`."""

    def init(name: str, p: torch.nn.Parameter) -> None:
        if name.endswith("mlp.gate.weight") or "shared_expert_gate" in name:
            p.normal_(0.0, 0.5)  # decisive routing: near-ties would flip on rounding noise
        elif "experts" in name:
            p.normal_(0.0, 0.05)

    return save_random_model(path, lambda vocab, eos: make_moe_config(arch, vocab, eos), seed, init)
