"""Reads checkpoint tensors (single or sharded safetensors) or makes dummy ones, with a progress bar."""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from runtime.errors import WeightLoadError
from runtime.layers.rotary import RotaryEmbedding
from runtime.model_config import ModelConfig

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
    files = safetensors_files(model_path)
    bar = tqdm(total=len(files), desc="Loading safetensors shards", unit="shard",
               disable=None if show_progress else True)  # None: on a terminal only, not in a Ray actor's log
    for f in files:
        with open_safetensors(f) as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
        bar.update(1)
    bar.close()


def dummy_checkpoint(cfg: ModelConfig, seed: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights in the HF checkpoint's names and full shapes, one tensor at a time, each drawn from
    a generator seeded by (seed, name) on `device`. Loaded through load_weights like a real checkpoint,
    so every TP layout of the same config and seed holds the same model (TP=1 and TP=N compare)."""
    hd, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (heads * hd, h)), (p + "self_attn.k_proj.weight", (kv * hd, h)),
                   (p + "self_attn.v_proj.weight", (kv * hd, h)), (p + "self_attn.o_proj.weight", (h, heads * hd)),
                   (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        shapes += _moe_mlp_shapes(cfg, i, p) if cfg.is_sparse_layer(i) else _mlp_shapes(p + "mlp.", h, inter)
        if cfg.attention_bias:
            shapes += [(p + f"self_attn.{x}_proj.bias", (n * hd,)) for x, n in (("q", heads), ("k", kv), ("v", kv))]
        if cfg.qk_norm:
            shapes += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
    shapes.append(("model.norm.weight", (h,)))
    if cfg.num_labels:  # a *ForSequenceClassification's score head (reward / classifier models)
        shapes.append(("score.weight", (cfg.num_labels, h)))
    if not cfg.tie_word_embeddings:
        shapes.append(("lm_head.weight", (cfg.vocab_size, h)))
    for name, shape in shapes:
        if "norm" in name:
            yield name, torch.ones(shape, dtype=cfg.dtype, device=device)
            continue
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        t = torch.empty(shape, dtype=cfg.dtype, device=device)
        yield name, t.uniform_(-0.02, 0.02, generator=gen)


def _mlp_shapes(p: str, h: int, inter: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(p + "gate_proj.weight", (inter, h)), (p + "up_proj.weight", (inter, h)), (p + "down_proj.weight", (h, inter))]


def _moe_mlp_shapes(cfg: ModelConfig, layer: int, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """A sparse layer's tensors as its HF checkpoint names them (Mixtral: block_sparse_moe, w1 / w3 / w2)."""
    moe, h = cfg.moe, cfg.hidden_size
    assert moe is not None  # is_sparse_layer said so
    inter = moe.moe_intermediate_size
    if cfg.model_type == "mixtral":
        p += "block_sparse_moe."
        shapes = [(p + f"experts.{e}.{w}.weight", (h, inter) if w == "w2" else (inter, h))
                  for e in range(moe.num_experts) for w in ("w1", "w3", "w2")]
    else:
        p += "mlp."
        shapes = [s for e in range(moe.num_experts) for s in _mlp_shapes(p + f"experts.{e}.", h, inter)]
    shapes.append((p + "gate.weight", (moe.num_experts, h)))
    if moe.shared_expert_intermediate_size:
        shapes += _mlp_shapes(p + "shared_expert.", h, moe.shared_expert_intermediate_size)
        shapes.append((p + "shared_expert_gate.weight", (1, h)))
    return shapes


def open_safetensors(f: Path) -> Any:
    """safetensors' handle of checkpoint file f (torch tensors); WeightLoadError naming the file."""
    from safetensors import safe_open

    try:
        return safe_open(str(f), framework="pt")
    except Exception as e:  # safetensors raises its own error types
        raise WeightLoadError(f"cannot read checkpoint file {f}: {e}") from None


def build_model(make: Callable[[], nn.Module], quant: Any, device: torch.device) -> nn.Module:
    """make() on `device`, with quant's parameters (prepare) in place. Where every quantized weight comes from
    the checkpoint (quant.fills_every_weight: 4-bit and FP8 checkpoints), the model is built on the meta device
    first and its parameters allocated after prepare, so the 16-bit projections a quantized layer replaces are
    never allocated (a 70B AWQ / FP8 checkpoint would otherwise need the whole bf16 model's memory first)."""
    lazy = quant is not None and quant.fills_every_weight
    with torch.device("meta" if lazy else device):
        model = make()
    if quant is not None:
        quant.prepare(model)
    if lazy:
        materialize(model, device)
    return model


def materialize(model: nn.Module, device: torch.device) -> None:
    """A meta-device model's parameters allocated on `device` (uninitialized: load_weights fills them), each the
    same Python object (shared ones stay shared, weight_loader and other attributes stay), and the rotary
    tables computed there."""
    for p in model.parameters():  # each shared parameter once
        if p.device.type == "meta":
            attrs = dict(p.__dict__)
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                     requires_grad=False))
            p.__dict__.update(attrs)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.rebuild(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"materialize: {left[:4]} still on the meta device")
