"""Per-channel FP8 weight scales (runtime/layers/fp8_weight_scales.py): the searched scales never round a
row worse than amax / 448, keep every value in range, are one of the searched amax / (448 r), and amax
reproduces the old quantize_per_channel bit for bit; --quantization fp8 loads with the method
--fp8-weight-scales names (a bad name is a clear error) and stays close to the full-precision model;
--fp8-weight-only runs the w8a16 arithmetic (the GPU GEMV's torch reference) on CPU."""

from __future__ import annotations

import pytest
import torch
from runner_driver import RunnerDriver

from kernels.fp8_gemv import fp8_linear_small_m_ref
from runtime.layers.fp8_linear import FP8, fp8_linear, quantize_per_channel
from runtime.layers.fp8_weight_scales import (
    SEARCH_RATIOS,
    amax_scales,
    mse_scales,
    quantize_weight,
    quantize_with_scales,
)
from runtime.model_executor.forward_mode import ForwardMode

PROMPT = [7, 19, 23, 150, 151, 9, 88, 301, 42, 5, 66, 67]


def _row_err(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w - quantize_with_scales(w, scale).float() * scale).square().sum(1)


def _weights() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 200, generator=gen) * 0.03
    w[5, 17] = 0.9  # an outlier row
    w[7] = 0.0  # an all-zero row keeps a finite scale
    w[9, :] = torch.linspace(-1, 1, 200) * 2.0 ** -12  # tiny values: subnormal under some scales
    return w


def test_searched_scales_never_round_worse_than_amax() -> None:
    w = _weights()
    amax, mse = amax_scales(w), mse_scales(w)
    err_amax, err_mse = _row_err(w, amax), _row_err(w, mse)
    assert bool((err_mse <= err_amax).all())
    assert float(err_mse.sum()) < 0.8 * float(err_amax.sum())  # the search gains on random rows
    assert bool(torch.isfinite(mse).all()) and bool((mse > 0).all())
    assert float((w / mse).abs().max()) <= 448.0 * (1 + 1e-6)  # never clips: every r <= 1 (fp32 rounding aside)
    ratios = amax / mse  # each scale is amax / (448 r) for a searched r
    hits = (ratios - torch.tensor(SEARCH_RATIOS)[None, :]).abs().min(1).values
    assert float(hits.max()) < 1e-6


def test_amax_method_is_the_old_per_channel_rule_bit_for_bit() -> None:
    w = _weights().bfloat16()
    w8, s = quantize_weight(w, "amax")
    w8_old, s_old = quantize_per_channel(w)
    assert w8.dtype == FP8 and torch.equal(w8.view(torch.uint8), w8_old.view(torch.uint8)) and torch.equal(s, s_old)
    w8m, sm = quantize_weight(w, "mse")
    assert sm.shape == (96, 1) and sm.dtype == torch.float32
    # the dequantized weight is closer to w with the searched scales
    assert float((w8m.float() * sm - w.float()).norm()) < float((w8.float() * s - w.float()).norm())


def test_row_chunking_does_not_change_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.layers.fp8_weight_scales as mod

    w = _weights()
    whole = mse_scales(w)
    monkeypatch.setattr(mod, "_CHUNK_ELEMS", 7 * 200)  # 7 rows a step
    assert torch.equal(mse_scales(w), whole)


def test_bad_method_names_are_clear_errors() -> None:
    from runtime.config import ServerArgs
    from runtime.errors import ServerArgsError

    with pytest.raises(ValueError, match="method 'int4'"):
        quantize_weight(torch.ones(2, 2), "int4")
    with pytest.raises(ServerArgsError, match="--fp8-weight-scales"):
        ServerArgs(quantization="fp8", fp8_weight_scales="minmax")


def test_weight_only_linear_is_the_gemv_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(21, 64, generator=gen), torch.randn(40, 64, generator=gen) * 0.05, torch.randn(40)
    w8, ws = quantize_weight(w, "mse")
    got = fp8_linear(x, w8, ws, b, weight_only=True)
    assert torch.equal(got, fp8_linear_small_m_ref(x, w8, ws, b))
    w8a8 = fp8_linear(x, w8, ws, b)
    assert not torch.equal(got, w8a8)  # activations are not quantized
    exact = x @ w.t() + b
    assert float((got - exact).norm()) < float((w8a8 - exact).norm())


def _logits(path, **kw) -> tuple[torch.Tensor, RunnerDriver]:
    d = RunnerDriver(path, **kw)
    row = d.new_row()
    _, a = d.step(ForwardMode.EXTEND, [row], [PROMPT])
    _, b = d.step(ForwardMode.DECODE, [row], [[5]])
    return torch.cat([a.next_token_logits, b.next_token_logits]).float(), d


@pytest.mark.parametrize(("method", "weight_only"), [("mse", False), ("amax", False), ("mse", True)])
def test_quantize_at_load_methods_close_to_full_precision(tiny_llama, method: str, weight_only: bool) -> None:
    ref, _ = _logits(tiny_llama)
    got, d = _logits(tiny_llama, quantization="fp8", fp8_weight_scales=method, fp8_weight_only=weight_only)
    down = d.runner.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == FP8 and down.weight_only == weight_only
    # the loaded layer holds exactly what quantize_weight makes of the checkpoint's weight
    plain = RunnerDriver(tiny_llama).runner.model.model.layers[0].mlp.down_proj.weight.data
    w8, s = quantize_weight(plain, method)
    assert torch.equal(down.weight.view(torch.uint8), w8.view(torch.uint8)) and torch.equal(down.weight_scale, s)
    assert float((got - ref).abs().max()) < 0.1 * float(ref.abs().max())


def test_act_weighted_scales_read_a_calibration_prefill(tiny_llama) -> None:
    """Every projection's input is seen by the calibration prefill; the loaded weights round with less
    activation-weighted error than amax / 448; the model stays close to full precision."""
    from runtime.layers.fp8_linear import fp8_linear_modules
    from runtime.model_executor.fp8_calibrator import Fp8Calibrator

    plain = RunnerDriver(tiny_llama).runner
    modules = [m for _, m in fp8_linear_modules(plain.model)]
    stats = Fp8Calibrator(modules, lambda: plain._calibration_prefill(plain.model, str(tiny_llama))
                          ).column_mean_squares()
    assert len(stats) == len(modules)
    assert all(s.shape == (m.weight.shape[1],) and bool((s >= 0).all()) and float(s.sum()) > 0
               for m, s in zip(modules, (stats[id(m)] for m in modules), strict=True))
    from runtime.config import ServerArgs

    assert ServerArgs().fp8_weight_scales == "act_weighted"  # the default
    ref, _ = _logits(tiny_llama)
    got, d = _logits(tiny_llama, quantization="fp8")
    loaded = [m for _, m in fp8_linear_modules(d.runner.model)]
    for m0, m in zip(modules, loaded, strict=True):
        w, h = m0.weight.data.float(), stats[id(m0)]
        err = ((m.weight.float() * m.weight_scale - w).square() * h).sum()
        w8, s = quantize_weight(w, "amax")
        assert float(err) <= float(((w8.float() * s - w).square() * h).sum()) * 1.001
    assert float((got - ref).abs().max()) < 0.1 * float(ref.abs().max())
    with pytest.raises(ValueError, match="act_weighted scales need"):
        quantize_weight(torch.ones(2, 2), "act_weighted")
