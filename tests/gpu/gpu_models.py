"""Random bf16 Llama checkpoints for the GPU tests (real config.json + safetensors, built on the device)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


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
