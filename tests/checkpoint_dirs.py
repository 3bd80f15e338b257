"""Checkpoint folders the quantized-checkpoint writers and tests make from a tiny HF checkpoint: its tensors,
a copy with other tensors (config and tokenizer files kept), a copy with another quantization_config. One
place for the folder layout (one model.safetensors, no index) the writers tests/fp8_checkpoints.py,
tests/quant/int4_checkpoints.py and tests/quant_fp8/block_fp8_checkpoints.py share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_linear_weight(name: str) -> bool:
    """A decoder layer's linear weight (what the quantized layouts quantize), e.g. `...mlp.up_proj.weight`."""
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def checkpoint_tensors(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def save_checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor], qcfg: dict | None = None) -> Path:
    """dst: `src`'s config and tokenizer files with `tensors` as its one model.safetensors (the source's
    shard index dropped), and config.json's quantization_config set to `qcfg` when given."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"))
    if qcfg is not None:
        set_quant_config(dst, qcfg)
    return dst


def set_quant_config(ckpt: Path, qcfg: dict) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))


def with_quant_config(src: Path, dst: Path, qcfg: dict) -> Path:
    """A copy of checkpoint `src` whose config.json says `qcfg` (its tensors unchanged)."""
    shutil.copytree(src, dst)
    set_quant_config(dst, qcfg)
    return dst
