"""Reads checkpoint tensors (single or sharded safetensors) or makes dummy ones, with a progress bar."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from runtime.errors import WeightLoadError

logger = logging.getLogger(__name__)


def safetensors_files(model_path: str | Path) -> list[Path]:
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightLoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = [root / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(f"checkpoint shard file(s) named in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {root} (use --load-format dummy for random weights)")
    return files


def iterate_safetensors(model_path: str | Path, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = safetensors_files(model_path)
    bar = tqdm(total=len(files), desc="Loading safetensors shards", disable=not show_progress, unit="shard")
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise WeightLoadError(f"cannot read checkpoint file {f}: {e}") from None
        with handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
        bar.update(1)
    bar.close()


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of the right shapes, small enough that activations stay finite in bf16. Drawn on
    the parameters' own device (a 70B model's worth of CPU random numbers would take minutes)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
            continue
        gen = gens.get(p.device)
        if gen is None:
            gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.data.uniform_(-0.02, 0.02, generator=gen)
