"""KVScales: the FP8 KV cache's per-layer dequantization scales (stored = x / scale, read = stored * scale).

One float for K and one for V per layer. Plain floats (not tensors) because every kernel takes them as
scalar arguments: each layer's launches get that layer's floats, so kernels and captured CUDA graphs are
the same as with one global scale. Where they come from is the model runner's business (the checkpoint's
`k_scale`/`v_scale` tensors, a calibration prefill, or `--kv-cache-scale`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.mem_cache.kv_quant import FP8_E4M3_MAX


@dataclass(frozen=True, slots=True)
class KVScales:
    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str = "static"  # static, checkpoint or calibrate: logged at start and kept in benchmark JSON

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"KV scales: {len(self.k)} K scales but {len(self.v)} V scales")
        for name, vals in (("K", self.k), ("V", self.v)):
            for i, s in enumerate(vals):
                if not (math.isfinite(s) and s > 0):
                    raise ValueError(f"KV scales: layer {i}'s {name} scale must be a positive finite number, "
                                     f"got {s}")

    @classmethod
    def uniform(cls, num_layers: int, scale: float = 1.0) -> KVScales:
        return cls((float(scale),) * num_layers, (float(scale),) * num_layers, "static")

    @classmethod
    def from_amax(cls, k_amax: Sequence[float], v_amax: Sequence[float], headroom: float) -> KVScales:
        """scale = amax * headroom / 448: the largest value seen maps to 448 / headroom, so a value up to
        `headroom` times larger still fits before saturating. A layer whose K or V was all zeros keeps 1.0."""
        def scale(a: float) -> float:
            return float(a) * headroom / FP8_E4M3_MAX if a > 0 and math.isfinite(a) else 1.0
        return cls(tuple(scale(a) for a in k_amax), tuple(scale(a) for a in v_amax), "calibrate")

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def summary(self) -> str:
        return (f"{self.source}: K {min(self.k):.3g}..{max(self.k):.3g}, "
                f"V {min(self.v):.3g}..{max(self.v):.3g} over {self.num_layers} layers")
