"""Writes FP8 copies of a (tiny) HF checkpoint in the layouts published FP8 Llama checkpoints use:
compressed-tensors (float-quantized; "channel" or "tensor" weight scales, with static input scales the
loader must skip) and fbgemm_fp8 (per-channel weight_scale [out, 1]). Weights are quantized exactly as
runtime/layers/fp8_weight_scales.quantize_weight does with
its data-free mse scales, so a channel-scaled checkpoint loads to the very model that --quantization fp8
makes from the original with --fp8-weight-scales mse (the default, act_weighted, also reads a calibration
prefill's activations, which a checkpoint writer here does not run)."""

from __future__ import annotations

from pathlib import Path

import torch
from checkpoint_dirs import checkpoint_tensors, is_linear_weight, save_checkpoint

F8 = torch.float8_e4m3fn


def _quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    from runtime.layers.fp8_weight_scales import quantize_weight

    if strategy == "channel":
        return quantize_weight(w, "mse")
    scale = (w.float().abs().amax() / 448.0).reshape(1)
    return (w.float() / scale).clamp(-448, 448).to(F8), scale


def write_fp8_checkpoint(src: Path, dst: Path, layout: str, strategy: str = "channel") -> Path:
    out: dict[str, torch.Tensor] = {}
    for name, t in checkpoint_tensors(src).items():
        if is_linear_weight(name):
            w8, scale = _quantize(t, strategy)
            out[name], out[name[:-len("weight")] + "weight_scale"] = w8, scale.to(torch.float32)
            if layout == "compressed-tensors":
                out[name[:-len("weight")] + "input_scale"] = torch.ones(1)
        else:
            out[name] = t.contiguous()
    return save_checkpoint(src, dst, out, quant_config(layout, strategy))


def quant_config(layout: str, strategy: str = "channel") -> dict:
    if layout == "fbgemm_fp8":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}
