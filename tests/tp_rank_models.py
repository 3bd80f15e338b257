"""The model each tensor-parallel rank builds from a (quantized) checkpoint, loaded without a process group:
what the TP-sharding tests of the quantized layouts put together and compare with the whole model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def rank_model(ckpt: Path, rank: int, tp: int) -> torch.nn.Module:
    """Rank `rank` of `tp`'s model for ckpt's config.json, before any weights are loaded."""
    from runtime.distributed.parallel_group import ParallelGroup
    from runtime.model_config import ModelConfig
    from runtime.models.parallel_context import ParallelContext
    from runtime.models.registry import get_model_class

    cfg = ModelConfig.from_pretrained(ckpt)
    return get_model_class(cfg.architecture)(cfg, ParallelContext.tensor_parallel(ParallelGroup(rank, tp)))


def tp_rank_models(ckpt: Path, tp: int, quant: Any) -> list[torch.nn.Module]:
    """Every rank's model with its shards loaded; quant: the checkpoint's resolved weight quantization
    (Int4Weights / Fp8Weights)."""
    from runtime.model_executor.weight_loader import iterate_safetensors

    models = []
    for rank in range(tp):
        model = rank_model(ckpt, rank, tp)
        quant.prepare(model)
        model.load_weights(iterate_safetensors(ckpt, show_progress=False))
        quant.finish(model, torch.float32)
        models.append(model)
    return models
