"""FP8 weight scales for quantize-at-load, per output channel (--fp8-weight-scales):
- act_weighted (default): the scale whose e4m3 rounding of the row has the least error weighed per column
  by the input's mean square over a calibration prefill (runtime/model_executor/fp8_calibrator.py), i.e.
  the layer's output error to a diagonal approximation;
- mse: the same search, columns weighed equally (data-free; what dummy-weight loads use);
- amax: amax / 448, the old rule.

Why a search and not amax / 448: e4m3 is a floating-point grid with 3 mantissa bits, so a row's rounding
error depends on where its values fall between grid points, and amax / 448 fixes that alignment by the one
largest value. Any scale amax / (448 r) with r in (0.5, 1] keeps every value in range (no clipping) and
slides the row along the grid (r = 0.5 is r = 1 one binade down), so trying SEARCH_RATIOS covers the
alignments; per row the best one wins (ties keep amax / 448). The result is the same format (fp8 weight,
fp32 scale [N, 1]) every FP8 path already runs: the w8a16 GEMV, torch._scaled_mm, the one-launch
activation quantize, the emulated GEMM, TP sharding (a row-parallel rank searches over its own columns).
Measured on SmolLM2 (benchmarks/README.md, FP8; results/fp8_weights_accuracy_cpu.json): act_weighted lifts
top-1 agreement with bf16 from 93.6% to 95.1% (w8a16) and from 92.2% to 93.2% (w8a8); the alternatives
tried (clipping scales, GPTQ, a Hadamard rotation of the down projection's input, finer activation
scales) are in results/fp8_weight_error_sources_cpu.json.

Checkpoints that are already FP8 (compressed-tensors, fbgemm_fp8) keep their own scales: their fp8 values
were rounded with those scales, so re-scaling them could only add a second rounding."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_AMAX = 1e-12  # an all-zero row keeps a finite scale
METHODS = ("act_weighted", "mse", "amax")
# r = 1 first (amax / 448), then 31 finer alignments down to r = 0.5 + 1/64 (r = 0.5 repeats r = 1).
SEARCH_RATIOS = tuple(1.0 - i / 64 for i in range(32))
_CHUNK_ELEMS = 1 << 24  # values per search step: each fp32 temporary stays <= 64 MiB on the widest layers


def amax_scales(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] → fp32 [N, 1]: each row's amax / 448."""
    return w.float().abs().amax(dim=1, keepdim=True).clamp_(min=_MIN_AMAX) / FP8_MAX


def mse_scales(w: torch.Tensor, ratios: tuple[float, ...] = SEARCH_RATIOS,
               col_weight: torch.Tensor | None = None) -> torch.Tensor:
    """w [N, K] → fp32 [N, 1]: per row, the scale amax / (448 r), r in ratios, with the least squared e4m3
    rounding error (the first ratio wins ties); col_weight [K] weighs each column's squared error."""
    cw = None if col_weight is None else col_weight.to(device=w.device, dtype=torch.float32).reshape(1, -1)
    out = torch.empty(w.shape[0], 1, dtype=torch.float32, device=w.device)
    rows = max(1, _CHUNK_ELEMS // max(1, w.shape[1]))
    for lo in range(0, w.shape[0], rows):
        wf = w[lo:lo + rows].float()
        base = amax_scales(wf)
        best, best_err = base, None
        for r in ratios:
            s = base / r
            err = (wf - (wf / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8).float() * s).square_()
            err = (err if cw is None else err.mul_(cw)).sum(1, keepdim=True)
            if best_err is None:
                best, best_err = s, err
            else:
                better = err < best_err
                best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
        out[lo:lo + rows] = best
    return out


def quantize_with_scales(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w [N, K] / scale [N, 1], saturated to ±448 and rounded to e4m3."""
    return (w.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_weight(w: torch.Tensor, method: str, col_weight: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → (fp8 [N, K], fp32 scale [N, 1]) by `method` (one of METHODS); act_weighted needs
    col_weight [K] (the input's mean square per column)."""
    if method not in METHODS:
        raise ValueError(f"quantize_weight: method {method!r} is not one of {', '.join(METHODS)}")
    if method == "act_weighted" and col_weight is None:
        raise ValueError("quantize_weight: act_weighted scales need the input's per-column mean square")
    if method == "amax":
        scale = amax_scales(w)
    else:
        scale = mse_scales(w, col_weight=col_weight if method == "act_weighted" else None)
    return quantize_with_scales(w, scale), scale
