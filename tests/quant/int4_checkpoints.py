"""Writes 4-bit copies of a (tiny) HF checkpoint as AutoAWQ (GEMM), AutoGPTQ (v1 format) and llm-compressor
(compressed-tensors pack-quantized) save them, plus the dequantized fp32 copy HF transformers runs as the
reference. Round-to-nearest min/max quantization per group; the packing is written out plainly here,
independently of kernels/w4a16_gemm.py, so a loader that packs or orders nibbles wrongly cannot agree."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch
from checkpoint_dirs import checkpoint_tensors, is_linear_weight, save_checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: nibble i holds column 8c + AWQ_ORDER[i]


def quantize(w: torch.Tensor, group: int, sym: bool, min_zero: int = 0) -> tuple[torch.Tensor, ...]:
    """w [N, K] → (q [N, K] in 0..15, zero [N, K/G], scale [N, K/G] fp16-representable fp32)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    if sym:  # AutoGPTQ sym / compressed-tensors symmetric: zero point 8
        scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-6).half().float()
        zero = torch.full_like(scale, 8)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        zero = (-lo / scale).round().clamp(min_zero, 15)
    q = (g / scale[..., None]).round() + zero[..., None]
    return q.clamp(0, 15).reshape(n, k).long(), zero.long(), scale


def dequantize(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return ((q - zero.repeat_interleave(group, 1)).float() * scale.repeat_interleave(group, 1))


def pack_columns(v: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] values 0..15 → [R, C/8] int32: nibble i of word c holds column 8c + order[i]."""
    rows, cols = v.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for i in range(8):
            out[:, c] |= v[:, 8 * c + order[i]].long() << (4 * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def act_order(name: str, k: int) -> torch.Tensor:
    """A random input-column order per layer input (q/k/v share theirs, gate/up theirs, as GPTQ's does)."""
    layer, proj = name.split(".")[2], name.split(".")[-2]
    key = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}.get(proj, proj)
    return torch.randperm(k, generator=torch.Generator().manual_seed(zlib.crc32(f"{layer}.{key}".encode())))


def write_int4_checkpoint(src: Path, dst: Path, layout: str, group: int, sym: bool = False,
                          desc_act: bool = False) -> tuple[Path, Path]:
    """(the 4-bit checkpoint, its dequantized fp32 twin) of `src` in `layout`: awq | gptq | compressed-tensors.
    desc_act (gptq): groups are runs of a random column order, g_idx says each column's group."""
    packed, deq = {}, {}
    for name, t in checkpoint_tensors(src).items():
        if not is_linear_weight(name):
            packed[name] = deq[name] = t.contiguous()
            continue
        base = name[: -len("weight")]
        n, k = t.shape
        cols = act_order(name, k) if desc_act else torch.arange(k)  # groups are runs of columns in this order
        q, zero, scale = quantize(t[:, cols], group, sym, min_zero=1 if layout == "gptq" else 0)
        if layout == "compressed-tensors" and sym:  # llm-compressor keeps the model's dtype: bf16 scales
            scale = scale.to(torch.bfloat16).float()
        deq[name] = torch.empty(n, k).index_copy_(1, cols, dequantize(q, zero, scale, group))
        q = torch.empty_like(q).index_copy_(1, cols, q)  # back in the checkpoint's column order
        if layout == "awq":  # qweight [K, N/8], qzeros [K/G, N/8] in AWQ order; scales [K/G, N] fp16
            packed[base + "qweight"] = pack_columns(q.t(), AWQ_ORDER)
            packed[base + "qzeros"] = pack_columns(zero.t(), AWQ_ORDER)
            packed[base + "scales"] = scale.t().half().contiguous()
        elif layout == "gptq":  # qweight [K/8, N] K-packed; qzeros [K/G, N/8] hold zero - 1
            packed[base + "qweight"] = pack_columns(q).t().contiguous()
            packed[base + "qzeros"] = pack_columns(zero.t() - 1)
            packed[base + "scales"] = scale.t().half().contiguous()
            packed[base + "g_idx"] = torch.empty(k, dtype=torch.int32).index_copy_(
                0, cols, (torch.arange(k) // group).to(torch.int32))
        else:  # weight_packed [N, K/8] of the signed values + 8; weight_scale [N, K/G]; zero points N-packed
            packed[base + "weight_packed"] = pack_columns(q)
            packed[base + "weight_scale"] = scale.to(torch.bfloat16) if sym else scale.half()
            packed[base + "weight_shape"] = torch.tensor([n, k])
            if not sym:
                packed[base + "weight_zero_point"] = pack_columns(zero.t()).t().contiguous()
    qcfg = {**quant_config(layout, group, sym), **({"desc_act": True} if desc_act else {})}
    return (save_checkpoint(src, dst / layout, packed, qcfg),
            save_checkpoint(src, dst / f"{layout}-dequantized", deq))


def quant_config(layout: str, group: int, sym: bool = False) -> dict:
    """config.json's quantization_config as transformers / AutoGPTQ / llm-compressor write it."""
    if layout == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if layout == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": sym,
                "true_sequential": True, "damp_percent": 0.01, "static_groups": False, "checkpoint_format": "gptq",
                "model_name_or_path": None, "model_file_base_name": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group",
                            "group_size": group, "dynamic": False, "actorder": None, "observer": "minmax"}}}}
