"""Fp8Calibrator: each FP8-bound projection's input mean square per column over one calibration prefill
through the still-unquantized model, for --fp8-weight-scales act_weighted.

Why: a weight column's rounding error reaches the output scaled by that column's input, so the output
error E|(W - Q(W)) x|^2 is, to a diagonal approximation, sum_k E[x_k^2] (w_k - q(w_k))^2; the scale search
(runtime/layers/fp8_weight_scales.py) weighs columns by E[x_k^2] instead of equally. The prefill is the KV
calibrator's chat-templated text (KVCalibrator.calibration_ids), run by KVCalibrator's pool-free forward;
hooks read every projection's input on the way (the down projection's is SiLU(gate) * up:
RowParallelLinear.forward_silu_mul takes the module call while a hook is on it). Under TP a row-parallel rank sees its own columns."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class Fp8Calibrator:
    def __init__(self, modules: list[nn.Module], run_prefill: Callable[[], object]):
        self.modules, self.run_prefill = modules, run_prefill

    @torch.inference_mode()
    def column_mean_squares(self) -> dict[int, torch.Tensor]:
        """id(module) → fp32 [K]: mean over the prefill's tokens of each input column's square."""
        sums: dict[int, torch.Tensor] = {}
        counts: dict[int, int] = {}

        def hook(mod: nn.Module, inp: tuple[torch.Tensor, ...]) -> None:
            x = inp[0].reshape(-1, inp[0].shape[-1]).float()
            key = id(mod)
            sums[key] = sums.get(key, 0) + x.square().sum(0)
            counts[key] = counts.get(key, 0) + x.shape[0]

        handles = [m.register_forward_pre_hook(hook) for m in self.modules]
        try:
            self.run_prefill()
        finally:
            for h in handles:
                h.remove()
        missing = [m for m in self.modules if id(m) not in sums]
        if missing:
            raise RuntimeError(f"FP8 weight calibration: {len(missing)} projections saw no input in the prefill")
        out = {k: v / max(1, counts[k]) for k, v in sums.items()}
        if not all(bool(torch.isfinite(v).all()) for v in out.values()):
            raise RuntimeError("FP8 weight calibration saw non-finite activations; the model's weights are broken "
                               "(or use --fp8-weight-scales mse)")
        return out
