"""KVRangeProbe: a LoRA adapter's K/V range on the FP8 KV cache's calibration text, checked as it is read.

The FP8 KV scales (kv_cache_format.py) map each layer's K/V amax on one calibration prefill to 448 / 4, so a
value up to CALIBRATION_HEADROOM (4x) that amax still fits: room sized for the gap between that text and
real prompts (1.75x measured on SmolLM2). An adapter on k_proj / v_proj adds s (x A^T) B^T to K / V, which
the scales never saw: one whose term outgrows that range is clamped to +-448 on most tokens, silently (a
v_proj B x8 on the tiny test Llama: ~60% of V's entries; x40: 30x the FP8 KV error against HF).

So with --enable-lora the calibration prefill also keeps (KVRangeCapture), per layer, the qkv projection's
input rows x, the base K before its norm and rotary, and the base V as the pool stores it (rotated). An
adapter, read at start or at run time (runtime/lora/lora_manager.py), has its K/V terms computed on those
rows on the host — K through the layer's k_norm, the rotary of each row's position and the KV rotation, as
Attention.forward_rotary does — and its amax compared with each layer's range, scale x 448.

An estimate to first order: each layer's terms run on the base model's input to that layer. Exact for layer
0; deeper, the adapter's earlier layers move that input too, which only the whole model could recompute.
On the tiny test Llama (adapters on every layer, no clipping) layer 1's true amax was 0.57-1.07x the
estimate (a v_proj B x8: 5.7x the range against 10.1x estimated); a trained adapter moves less.

Host memory per rank: the rows, at most MAX_BYTES (64 MiB) for all layers (an 8B Llama keeps ~170 of the
calibration text's rows: (hidden + 2 KV widths) x 2 bytes x 32 layers a row); past that the rows with the
largest input norms (the largest term any given A/B gives) and those holding the base's largest K/V, half
each. Besides: a calibrated rotation's K matrices (layers x KV heads x D x D, model dtype: 8 MiB on an 8B
Llama) and the rotary table's rows of the calibration positions. Nothing on the device after start, so a
load at run time (another thread) touches no device memory.

Which adapters are refused, and which get a warning: see TOLERANCE. The base model is never checked or
refused; where static or checkpoint scales already clip the base, an adapter is judged against what the base
reaches instead of the range. The probe describes the weights at start (a live weight update changes W_k /
W_v but, as it does not the scales, not the probe either)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from runtime.mem_cache.kv_quant import FP8_E4M3_MAX
from runtime.mem_cache.kv_rotation import KVRotation
from runtime.mem_cache.kv_scales import KVScales

logger = logging.getLogger(__name__)

MAX_BYTES = 64 << 20  # host memory for the kept rows, all layers of this rank together
MIN_ROWS = 32  # kept whatever the budget (a 400B model still gets a sample worth the name)

# An adapter whose K or V amax on the calibration text passes TOLERANCE x the range (scale x 448) is refused.
# Measured on the tiny test Llama / Qwen2 (CPU, mean |dlogprob| against HF on the merged weights; FP8 KV
# without LoRA: 0.0022 / 0.0013): a v_proj term at 1.2-1.5x the range costs 0.0026-0.0031 / 0.0019-0.0022
# (the committed `vo` test adapter: 1.22x), at 1.9-2.0x 0.0032 / 0.0027, at 2.5-2.7x 0.012 / 0.0098 (5x the
# base's), at 10x 0.05-0.06; K tolerates more (3.3x: 0.0033). So a few clamped values cost little and 1x is
# not the line; 1.5x stays below where the error takes off (~2.5x) by the margin real prompts take past the
# calibration text (the base's: up to 1.75x on SmolLM2, what the 4x headroom is for).
TOLERANCE = 1.5
# Past this the prompts' measured reach past the calibration text (1.75x) no longer fits: a warning at load.
WARN_AT = 1 / 1.75


@dataclass(frozen=True, slots=True)
class _Layer:
    x: torch.Tensor  # [R, hidden] the qkv projection's input rows kept (model dtype, host)
    k_raw: torch.Tensor  # [R, kv] the base K before its norm and rotary (model dtype, this rank's heads)
    v_pool: torch.Tensor  # [R, kv] the base V as the pool stores it (rotated where there is a rotation)
    positions: torch.Tensor  # [R] each kept row's position in the calibration text
    k_norm: tuple[torch.Tensor, float] | None  # (weight [D] fp32, eps): Qwen3's per-head K norm
    k_mat: torch.Tensor | None  # the rotation's K matrix ([D, D] or [Hkv, D, D], fp32), None: no rotation
    limits: tuple[float, float]  # (K, V) scale x 448: the largest value the pool keeps
    base: tuple[float, float]  # (K, V) the base model's amax over the whole calibration text, as stored


class KVRangeCapture:
    """Hooks on every layer's qkv projection for the calibration prefill: its input and its K/V output."""

    def __init__(self, attns: list[nn.Module]):
        self.attns = attns
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(attns)

    @classmethod
    def for_model(cls, model: nn.Module) -> KVRangeCapture | None:
        """None where the layers are not ones LoRA serves (fused qkv, rotary: LoraManager refuses the model)."""
        attns = [getattr(layer, "self_attn", None) for layer in getattr(getattr(model, "model", None), "layers", ())]
        if not attns or not all(hasattr(a, "qkv_proj") and hasattr(a, "rotary_emb") for a in attns):
            return None
        return cls(attns)

    @contextmanager
    def recording(self) -> Iterator[KVRangeCapture]:
        def hook(i: int):
            def keep(mod: nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
                attn = self.attns[i]
                x = inp[0].reshape(-1, inp[0].shape[-1])
                q, kv = attn.q_size, attn.kv_size
                # copies: the rotary and the rotation later work in place on the qkv output (CUDA)
                self.seen[i] = (x.clone(), out[:, q:q + kv].clone(), out[:, q + kv:q + 2 * kv].clone())
            return keep

        handles = [a.qkv_proj.register_forward_hook(hook(i)) for i, a in enumerate(self.attns)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    @property
    def complete(self) -> bool:
        return all(s is not None for s in self.seen)


def _rope(x: torch.Tensor, cos_sin: torch.Tensor, d: int) -> torch.Tensor:
    """Neox-style rotary (runtime/layers/rotary.py) of x [R, H*D] by each row's cos|sin [R, D]."""
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    x3 = x.view(x.shape[0], -1, d)
    x1, x2 = x3.chunk(2, dim=-1)
    return (x3 * cos + torch.cat([-x2, x1], -1) * sin).reshape(x.shape)


def _per_head(x: torch.Tensor, m: torch.Tensor, d: int) -> torch.Tensor:
    """KVRotation._per_head: x [R, H*D] times a shared [D, D] or a per-KV-head [H, D, D] matrix."""
    if m.dim() == 2:
        return (x.reshape(-1, d) @ m).view(x.shape)
    return torch.einsum("rhd,hde->rhe", x.view(x.shape[0], m.shape[0], d), m).reshape(x.shape)


class KVRangeProbe:
    def __init__(self, layers: list[_Layer], cos_sin: torch.Tensor, head_dim: int, q_size: int, kv_size: int,
                 v_mat: torch.Tensor | None):
        self.layers, self.cos_sin, self.head_dim = layers, cos_sin, head_dim
        self.q_size, self.kv_size = q_size, kv_size  # this rank's q and K/V widths in the qkv output
        self.v_mat = v_mat  # H where an adapter's V term is not already rotated (V not folded into W_v)

    @classmethod
    @torch.inference_mode()
    def build(cls, capture: KVRangeCapture, scales: KVScales, rotation: KVRotation | None,
              max_bytes: int = MAX_BYTES) -> KVRangeProbe:
        """From a capture of the calibration prefill and the scales and rotation resolved from it."""
        seen = [s for s in capture.seen if s is not None]
        if len(seen) != len(capture.attns):
            raise RuntimeError("KV range probe: the calibration prefill reached only "
                               f"{len(seen)} of {len(capture.attns)} layers' qkv projections")
        attn0 = capture.attns[0]
        d = attn0.head_dim
        t = seen[0][0].shape[0]
        cos_sin = attn0.rotary_emb.cos_sin_cache[:t].float().cpu()
        v_mat = None if rotation is None else rotation.v_mat.float().cpu()
        row_bytes = sum(x.shape[1] + k.shape[1] + v.shape[1] for x, k, v in seen) * seen[0][0].element_size()
        keep = min(t, max(MIN_ROWS, max_bytes // max(1, row_bytes)))
        layers = []
        for i, (attn, (x, k_raw, v_raw)) in enumerate(zip(capture.attns, seen, strict=True)):
            norm = attn.k_norm
            k_norm = None if norm is None else (norm.weight.float().cpu(), float(norm.eps))
            k_mat = None
            if rotation is not None:
                k_mat = (rotation.v_mat if rotation.mode == "hadamard" else rotation.k_mats[i]).float().cpu()
            x, k_raw = x.cpu(), k_raw.cpu()
            v_pool = v_raw.float().cpu() if v_mat is None else _per_head(v_raw.float().cpu(), v_mat, d)
            positions = torch.arange(t)
            layer = _Layer(x, k_raw, v_pool.to(x.dtype), positions, k_norm, k_mat,
                           (scales.k[i] * FP8_E4M3_MAX, scales.v[i] * FP8_E4M3_MAX), (0.0, 0.0))
            k_pool = cls._k_pool(layer, k_raw.float(), cos_sin, d)
            base = (float(k_pool.abs().amax()), float(v_pool.abs().amax()))
            rows = positions if keep >= t else cls._rows(x, k_pool, v_pool, keep)
            layers.append(_Layer(x[rows].contiguous(), k_raw[rows].contiguous(), layer.v_pool[rows].contiguous(),
                                 rows, k_norm, k_mat, layer.limits, base))
        capture.seen = [None] * len(capture.seen)  # its device copies go before kv_cache_format empties the cache
        return cls(layers, cos_sin, d, attn0.q_size, attn0.kv_size,
                   None if rotation is None or rotation.v_in_weights else v_mat)

    @staticmethod
    def _rows(x: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, keep: int) -> torch.Tensor:
        """`keep` rows: the largest inputs (where a given adapter term is largest), then the largest base K/V."""
        by_x = x.float().norm(dim=1).argsort(descending=True)[:keep // 2]
        peak = torch.maximum(k_pool.abs().amax(1), v_pool.abs().amax(1))
        peak[by_x] = -1.0
        return torch.cat([by_x, peak.argsort(descending=True)[:keep - by_x.numel()]]).sort().values

    @staticmethod
    def _k_pool(layer: _Layer, k: torch.Tensor, cos_sin: torch.Tensor, d: int) -> torch.Tensor:
        """K [R, kv] fp32 before its norm and rotary → as the pool stores it."""
        if layer.k_norm is not None:  # RMSNorm per head (runtime/layers/norm.py)
            weight, eps = layer.k_norm
            k3 = k.view(k.shape[0], -1, d)
            k = (k3 * torch.rsqrt(k3.square().mean(-1, keepdim=True) + eps) * weight).reshape(k.shape)
        k = _rope(k, cos_sin[layer.positions], d)
        return k if layer.k_mat is None else _per_head(k, layer.k_mat, d)

    @torch.inference_mode()
    def amax(self, layer_id: int, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """(K, V) amax as the pool would store them with an adapter's terms on this layer's qkv projection:
        pairs of (A [r, hidden], B [this rank's qkv outputs, r]: a sub-projection's rows placed as the fused
        weight's, scaled, V's folded where the model's V is), over the kept rows."""
        layer, q, kv = self.layers[layer_id], self.q_size, self.kv_size
        x = layer.x.float()
        d = torch.zeros(x.shape[0], q + 2 * kv)  # the terms, in the layout of this rank's qkv output
        for a, b in pairs:
            d += (x @ a.float().t()) @ b.float().t()
        dv = d[:, q + kv:] if self.v_mat is None else _per_head(d[:, q + kv:], self.v_mat, self.head_dim)
        k = self._k_pool(layer, layer.k_raw.float() + d[:, q:q + kv], self.cos_sin, self.head_dim)
        return float(k.abs().amax()), float((layer.v_pool.float() + dv).abs().amax())

    def check(self, where: str, terms: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> str | None:
        """None, or why the adapter (`where` names it) must be refused: its K/V terms (layer → pairs, as
        amax takes them) take some layer past TOLERANCE x its range, or x what the base model reaches there
        where that is more (static or checkpoint scales that clip the base are not the adapter's doing).
        Logs a warning where it is past WARN_AT of that without being refused."""
        worst: tuple[float, int, int, float] | None = None  # (ratio, layer, 0 K / 1 V, amax)
        for layer_id, pairs in terms.items():
            layer = self.layers[layer_id]
            for which, amax in enumerate(self.amax(layer_id, pairs)):
                if amax <= layer.base[which]:  # no wider than the base: never the adapter's doing
                    continue
                ratio = amax / max(layer.limits[which], layer.base[which])
                if worst is None or ratio > worst[0]:
                    worst = (ratio, layer_id, which, amax)
        if worst is None or worst[0] <= WARN_AT:
            return None
        ratio, layer_id, which, amax = worst
        layer, name = self.layers[layer_id], "KV"[which]
        limit, base = layer.limits[which], layer.base[which]
        against = "the FP8 KV cache's range" if limit >= base else "what the base model reaches (past the range)"
        what = (f"{where}: its {name.lower()}_proj term takes layer {layer_id}'s {name} to {ratio:.2f}x {against} "
                f"on the calibration text (|{name}| up to {amax:.4g}; the scale keeps {limit:.4g}; the base model "
                f"reaches {base:.4g})")
        if ratio <= TOLERANCE:
            logger.warning("LoRA %s: prompts that reach 1.75x past the calibration text, as the base's did on "
                           "SmolLM2, would have values clamped to the range", what)
            return None
        return (f"{what}; past {TOLERANCE}x its values would be clamped to +-448 on most prompts. Serve it "
                "without --kv-cache-dtype fp8_e4m3, or with a larger --kv-cache-scale")


def attach_probe(model: nn.Module, probe: KVRangeProbe) -> None:
    """Kept on the model for the LoraManager built after it (model_runner.py passes it only the model)."""
    model.kv_range_probe = probe


def probe_of(model: nn.Module) -> KVRangeProbe | None:
    """The probe kv_cache_format.py attached (an FP8 KV cache with --enable-lora), else None."""
    return getattr(model, "kv_range_probe", None)
