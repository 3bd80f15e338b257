"""Random bf16 Llama checkpoints for the GPU tests (real config.json + safetensors, built on the device)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# A 4-layer Llama with head_dim 128 and GQA 4 (the 8B's head shape), small enough to build on the device.
LLAMA_4L = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
                rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def save_bf16_llama(path: Path, config: dict[str, Any], device: str = "cuda") -> Path:
    """A LlamaForCausalLM of `config` with seed-0 random weights in bf16, saved to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return path
