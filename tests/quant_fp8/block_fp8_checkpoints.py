"""Writes block-wise FP8 copies of a tiny HF checkpoint as Qwen3-*-FP8 / DeepSeek store them: every linear
weight of the decoder layers float8_e4m3fn [N, K] with `weight_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)]
(scale = block amax / 448, w = w8 * scale), config.json's quantization_config as Qwen's files have it; and
the dequantized fp32 copy (the same tensors HF transformers then runs) with no quantization_config."""

from __future__ import annotations

from pathlib import Path

import torch
from checkpoint_dirs import checkpoint_tensors, is_linear_weight, save_checkpoint

F8 = torch.float8_e4m3fn


def qwen_fp8_config(block: list[int]) -> dict:
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": block}


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → (fp8 [N, K], fp32 scale_inv [ceil(N/bn), ceil(K/bk)]), the last blocks possibly short."""
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    scale = padded.view(nb, bn, kb, bk).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w.float() / full).clamp(-448, 448).to(F8), scale


def write_block_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int],
                               qcfg: dict | None = None, drop: str | None = None) -> tuple[Path, Path]:
    """(the FP8 checkpoint, its dequantized fp32 twin). drop: a tensor name left out of the FP8 one."""
    out, deq = {}, {}
    for name, t in checkpoint_tensors(src).items():
        if is_linear_weight(name):
            w8, scale = quantize_blocks(t, block)
            out[name], out[name + "_scale_inv"] = w8, scale
            deq[name] = w8.float() * scale.repeat_interleave(block[0], 0)[: t.shape[0]].repeat_interleave(
                block[1], 1)[:, : t.shape[1]]
        else:
            out[name] = deq[name] = t.contiguous()
    out.pop(drop, None)
    qcfg = qcfg if qcfg is not None else qwen_fp8_config(list(block))
    return save_checkpoint(src, dst / "fp8", out, qcfg), save_checkpoint(src, dst / "dequantized", deq)
