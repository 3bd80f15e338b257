"""fold_v_rotation: the FP8 KV rotation's V side moved into the attention weights, once, after calibration.

KVRotation (runtime/mem_cache/kv_rotation.py) stores v' = v H per head and turns the backend's output back
with o = o' H^T: one more launch per layer and step over the whole attention output (on an H100, ~0.7% of a
1000 x 1000 FP8 KV run's DECODE time and ~1.3% of its EXTEND). V has no rotary, so the same change of basis
can live in the weights instead (row vectors, per KV head h and query head g):

    v' = x W_v[h]^T H + b_v[h] H       →   W_v[h] ← H^T W_v[h],   b_v[h] ← b_v[h] H
    y  = sum_g o'_g H^T W_o[:, g]^T    →   W_o[:, g] ← W_o[:, g] H

(H the rotation's own matrix in the model dtype, products in fp32, rounded once to the weight dtype). Both
shards are per head under tensor parallelism (QKV rows, o_proj input columns), so each rank folds its own.
Where any layer's q/k/v or o projection is not a 16/32-bit dense weight (FP8 weights: rows of a head would
mix channels with their own scales) nothing is folded and the rotation keeps its transforms.
SHOAL_KV_V_FOLD=0 keeps them too (to measure the difference).

LoRA (--enable-lora) adds s (x A_v^T) B_v^T to v and s (o A_o^T) B_o^T to y: the same fold applies to those
terms, B_v[h] <- H^T B_v[h] and A_o[:, g] <- A_o[:, g] H (fold_lora_pair, on each adapter's host copy as
it is read, at start or at run time: runtime/lora/lora_manager.py). Each folded layer keeps its H
(folded_v_mat) for that. Folding the adapters keeps the fold's two launches a layer fewer and stays exact;
leaving V unfolded under LoRA would instead need the caller (kv_cache_format.py) to know LoRA is on."""

from __future__ import annotations

import logging
import os

import torch

from runtime.mem_cache.kv_rotation import KVRotation

logger = logging.getLogger(__name__)

_DENSE = (torch.bfloat16, torch.float16, torch.float32)


def _foldable(attn: torch.nn.Module) -> bool:
    projections = (getattr(attn, "qkv_proj", None), getattr(attn, "o_proj", None))
    return all(p is not None and isinstance(getattr(p, "weight", None), torch.Tensor) and p.weight.dtype in _DENSE
               and not hasattr(p, "weight_scale") for p in projections)


@torch.no_grad()
def fold_v_rotation(model: torch.nn.Module, rotation: KVRotation) -> KVRotation:
    """The rotation with V in the weights (`model`'s attention layers changed in place), or `rotation`
    itself where it cannot or should not be folded."""
    if rotation.v_in_weights or os.environ.get("SHOAL_KV_V_FOLD", "1") == "0":
        return rotation
    layers = [layer.self_attn for layer in getattr(getattr(model, "model", None), "layers", ())]
    if not layers or len(layers) != rotation.num_layers or not all(_foldable(a) for a in layers):
        logger.info("KV rotation: V stays a transform (a projection is not a 16/32-bit dense weight)")
        return rotation
    for attn in layers:
        fold_layer(attn, rotation)
        attn.v_rotation_fold = rotation.v_mat  # what an adapter's v/o terms must be folded by (folded_v_mat)
    return rotation.with_v_in_weights()


def folded_v_mat(attn: torch.nn.Module) -> torch.Tensor | None:
    """H (model dtype, the model's device) where fold_v_rotation folded V into this layer's W_v / W_o."""
    return getattr(attn, "v_rotation_fold", None)


@torch.no_grad()
def fold_lora_pair(module: str, a: torch.Tensor, b: torch.Tensor, h: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """An adapter's (A [r, in], B [out, r]) of one projection of a layer folded by H: v_proj's B by KV head,
    o_proj's A by query head (full, unsharded shapes: a head never straddles two ranks' shards); the other
    projections as they are. In A/B's dtype, products in fp32 with H as fold_layer uses it."""
    d, hf = h.shape[0], h.float().to(a.device)
    if module == "v_proj":
        b_v = b.float().reshape(-1, d, b.shape[1])  # [KV heads, D, r]
        b = torch.einsum("ed,her->hdr", hf, b_v).reshape(b.shape).to(b.dtype)  # H^T B_v[h]
    elif module == "o_proj":
        a_o = a.float().reshape(a.shape[0], -1, d)  # [r, q heads, D]
        a = torch.einsum("rgd,de->rge", a_o, hf).reshape(a.shape).to(a.dtype)  # A_o[:, g] H
    return a, b


FOLDED_PARTS = ("v_proj.weight", "v_proj.bias", "o_proj.weight")  # what fold_layer changes, by checkpoint name


@torch.no_grad()
def fold_layer(attn: torch.nn.Module, rotation: KVRotation, parts: tuple[str, ...] = FOLDED_PARTS) -> None:
    """One attention layer's fold, of the named parts only (a live weight update folds what it replaced:
    runtime/model_executor/weight_updater.py)."""
    h, d = rotation.v_mat.float(), rotation.head_dim
    qkv, o = attn.qkv_proj, attn.o_proj
    start, n = attn.q_size + attn.kv_size, attn.kv_size // d
    if "v_proj.weight" in parts:
        w_v = qkv.weight[start:start + attn.kv_size].view(n, d, -1)
        w_v.copy_(torch.einsum("ed,hei->hdi", h, w_v.float()).to(w_v.dtype))  # H^T W_v[h]
    if "v_proj.bias" in parts and qkv.bias is not None:
        b_v = qkv.bias[start:start + attn.kv_size].view(n, d)
        b_v.copy_((b_v.float() @ h).to(b_v.dtype))
    if "o_proj.weight" in parts:
        w_o = o.weight.view(o.weight.shape[0], -1, d)  # [out, local q heads, D]
        w_o.copy_(torch.einsum("ogd,de->oge", w_o.float(), h).to(w_o.dtype))
