"""Random PEFT-format LoRA adapters for the tiny test models, and the HF reference: the base checkpoint with
each adapter merged into its weights (W + scale * B @ A), which is what a correct LoRA forward computes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_adapter(path: Path, model_dir: Path, seed: int, modules: tuple[str, ...], r: int = 4,
                  alpha: float = 8, rslora: bool = False, **extra_config: Any) -> Path:
    """A PEFT adapter folder for model_dir's checkpoint: lora_A / lora_B of each module of every layer."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, inter = cfg.hidden_size, cfg.intermediate_size
    dims = {"q_proj": (h, cfg.num_attention_heads * hd), "k_proj": (h, cfg.num_key_value_heads * hd),
            "v_proj": (h, cfg.num_key_value_heads * hd), "o_proj": (cfg.num_attention_heads * hd, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for m in modules:
            fan_in, fan_out = dims[m]
            prefix = f"base_model.model.model.layers.{layer}.{'self_attn' if m in ATTN else 'mlp'}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) / math.sqrt(fan_in)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * 0.2
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(modules),
              "use_rslora": rslora, "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM", **extra_config}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def hf_merged(model_dir: Path, adapter: Path | None) -> Any:
    """HF transformers' model of model_dir with `adapter` merged into its weights (None: the base model)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter is None:
        return model
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    r = cfg["r"]
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            params[target].add_(scale * (b @ a))
    return model


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
