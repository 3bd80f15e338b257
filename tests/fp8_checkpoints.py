"""Writes FP8 copies of a (tiny) HF checkpoint in the layouts published FP8 Llama checkpoints use:
compressed-tensors (float-quantized; "channel" or "tensor" weight scales, with static input scales the
loader must skip) and fbgemm_fp8 (per-channel weight_scale [out, 1]). Weights are quantized exactly as
runtime/layers/fp8_weight_scales.quantize_weight does with
its data-free mse scales, so a channel-scaled checkpoint loads to the very model that --quantization fp8
makes from the original with --fp8-weight-scales mse (the default, act_weighted, also reads a calibration
prefill's activations, which a checkpoint writer here does not run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
F8 = torch.float8_e4m3fn


def _quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    from runtime.layers.fp8_weight_scales import quantize_weight

    if strategy == "channel":
        return quantize_weight(w, "mse")
    scale = (w.float().abs().amax() / 448.0).reshape(1)
    return (w.float() / scale).clamp(-448, 448).to(F8), scale


def write_fp8_checkpoint(src: Path, dst: Path, layout: str, strategy: str = "channel") -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            w8, scale = _quantize(t, strategy)
            out[name], out[name[:-len("weight")] + "weight_scale"] = w8, scale.to(torch.float32)
            if layout == "compressed-tensors":
                out[name[:-len("weight")] + "input_scale"] = torch.ones(1)
        else:
            out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant_config(layout, strategy)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def quant_config(layout: str, strategy: str = "channel") -> dict:
    if layout == "fbgemm_fp8":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}
