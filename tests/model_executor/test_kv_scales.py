"""Per-layer FP8 KV scales: read from a checkpoint's k_scale/v_scale tensors, calibrated from one prefill
(checked against the K/V amax HF transformers computes on the same weights and tokens), or one static
scale; bad scale tensors and conflicting flags are refused by name. Greedy decoding over each kind of
scales stays close to the full-precision pool and HF (tests/managers/test_engine_kv_scales.py runs the
engine end to end)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from runner_driver import RunnerDriver
from safetensors.torch import load_file, save_file

from runtime.config import ServerArgs
from runtime.errors import ServerArgsError, WeightLoadError
from runtime.mem_cache.kv_pool import TokenToKVPool
from runtime.mem_cache.kv_quant import FP8_E4M3_MAX
from runtime.mem_cache.kv_scales import KVScales
from runtime.model_executor.checkpoint_kv_scales import CheckpointKVScales
from runtime.model_executor.forward_mode import ForwardMode
from runtime.model_executor.kv_calibrator import CALIBRATION_HEADROOM, KVCalibrator

F8 = torch.float8_e4m3fn
PROMPT = [7, 19, 23, 150, 151, 9, 88, 301, 42, 5, 66, 67]


def with_tensors(src: Path, dst: Path, extra: dict[str, torch.Tensor]) -> Path:
    """A copy of the checkpoint `src` whose model.safetensors also holds `extra` (as FP8 checkpoints do)."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    save_file({**weights, **extra}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def scale_tensors(k: list[float], v: list[float]) -> dict[str, torch.Tensor]:
    out = {}
    for i, (ks, vs) in enumerate(zip(k, v)):
        out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(ks)
        out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(vs)
    return out


def greedy(d: RunnerDriver, n: int = 6) -> tuple[list[int], torch.Tensor]:
    row = d.new_row()
    _, out = d.step(ForwardMode.EXTEND, [row], [PROMPT])
    toks, logits = [int(out.next_token_logits.argmax())], [out.next_token_logits]
    for _ in range(n - 1):
        _, out = d.step(ForwardMode.DECODE, [row], [[toks[-1]]])
        toks.append(int(out.next_token_logits.argmax()))
        logits.append(out.next_token_logits)
    d.free(row)
    assert d.alloc.available_size() == d.runner.max_total_tokens
    return toks, torch.cat(logits).float()


def test_checkpoint_scales_are_loaded_per_layer(tiny_llama, tmp_path) -> None:
    k, v = [0.03, 0.011], [0.007, 0.02]
    path = with_tensors(tiny_llama, tmp_path / "ckpt", scale_tensors(k, v))
    d = RunnerDriver(path, kv_cache_dtype="fp8_e4m3")
    pool = d.runner.token_to_kv_pool
    assert pool.scales.source == "checkpoint"
    assert pool.k_scales == pytest.approx(k) and pool.v_scales == pytest.approx(v)
    # Each layer's rows are stored divided by its own scales: the same prompt in a pool of scale 1.0
    # holds (up to e4m3 rounding) the checkpoint pool's rows times them.
    static = RunnerDriver(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_cache_scale_mode="static")
    for drv in (d, static):
        drv.step(ForwardMode.EXTEND, [drv.new_row()], [PROMPT])
    slots = torch.tensor(d.slots[0])
    assert slots.tolist() == static.slots[0]
    for layer in range(2):
        for bufs, scale in (("k_buffers", k[layer]), ("v_buffers", v[layer])):
            want = getattr(static.runner.token_to_kv_pool, bufs)[layer][slots].float()
            got = getattr(pool, bufs)[layer][slots].float() * scale
            bad = (got - want).abs() > 0.13 * want.abs() + 0.01  # layer 1 also sees layer 0's FP8 error
            assert not bad.any(), (layer, bufs, got[bad], want[bad])
    d.free(0)
    ref_toks, ref = greedy(RunnerDriver(tiny_llama))
    toks, got = greedy(d)
    assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())
    # Asked for calibration, the same checkpoint's scales are ignored.
    assert RunnerDriver(path, kv_cache_dtype="fp8_e4m3", kv_cache_scale_mode="calibrate"
                        ).runner.token_to_kv_pool.scales.source == "calibrate"


@pytest.mark.parametrize("layout", ["kv_scale", "attn.k_scale", "output_scale", "per_head"])
def test_checkpoint_scale_layouts(tiny_llama, tmp_path, layout: str) -> None:
    extra = {}
    for i in range(2):
        p = f"model.layers.{i}.self_attn"
        if layout == "kv_scale":
            extra[f"{p}.kv_scale"] = torch.tensor([0.02 * (i + 1)])
        elif layout == "attn.k_scale":
            extra |= {f"{p}.attn.k_scale": torch.tensor(0.02 * (i + 1)), f"{p}.attn.v_scale": torch.tensor(0.01)}
        elif layout == "output_scale":
            extra |= {f"{p}.k_proj.output_scale": torch.tensor(0.02 * (i + 1)),
                      f"{p}.v_proj.output_scale": torch.tensor(0.01)}
        else:  # one per KV head (2): reduced to the largest, so every head fits
            extra |= {f"{p}.k_scale": torch.tensor([0.01, 0.02 * (i + 1)]), f"{p}.v_scale": torch.tensor([0.01, 0.005])}
    scales = CheckpointKVScales.read(with_tensors(tiny_llama, tmp_path / layout, extra), 2, 2)
    assert scales is not None and scales.k == pytest.approx((0.02, 0.04))
    assert scales.v == pytest.approx((0.02, 0.04) if layout == "kv_scale" else (0.01, 0.01))


@pytest.mark.parametrize("extra,match", [
    ({"model.layers.0.self_attn.k_scale": torch.tensor([0.1, 0.1, 0.1])}, r"k_scale has shape \(3,\)"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)}, "must be positive and finite"),
    ({"model.layers.0.self_attn.v_scale": torch.tensor(float("nan"))}, "must be positive and finite"),
    ({"model.layers.7.self_attn.k_scale": torch.tensor(0.1)}, "layer 7, but the model has 2 layers"),
    (scale_tensors([0.1], [0.1]), "not for layer 1 k_scale, layer 1 v_scale"),
], ids=["shape", "negative", "nan", "layer", "partial"])
def test_malformed_checkpoint_scales_are_refused(tiny_llama, tmp_path, extra, match: str) -> None:
    path = with_tensors(tiny_llama, tmp_path / "bad", extra)
    with pytest.raises(WeightLoadError, match=match):
        RunnerDriver(path, kv_cache_dtype="fp8_e4m3")


def test_checkpoint_mode_needs_scales_and_flags_conflict(tiny_llama) -> None:
    with pytest.raises(WeightLoadError, match="has no k_scale/v_scale tensors"):
        RunnerDriver(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_cache_scale_mode="checkpoint")
    with pytest.raises(ServerArgsError, match="--kv-cache-scale"):
        ServerArgs(kv_cache_scale=0.5, kv_cache_scale_mode="calibrate")
    with pytest.raises(ServerArgsError, match="--kv-cache-scale-mode"):
        ServerArgs(kv_cache_scale_mode="dynamic")


def hf_post_rotary_kv(path: Path, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's post-rotary K and V [T, Hkv*D] as HF transformers computes them (hooks on k_proj/v_proj,
    HF's own rotary applied to K)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    cfg = hf.config
    seen: dict[str, torch.Tensor] = {}
    hooks = [getattr(layer.self_attn, name).register_forward_hook(
        lambda mod, inp, out, key=f"{i}.{name}": seen.__setitem__(key, out))
        for i, layer in enumerate(hf.model.layers) for name in ("k_proj", "v_proj")]
    x = torch.tensor([ids])
    with torch.no_grad():
        hf(x)
        cos, sin = hf.model.rotary_emb(hf.model.embed_tokens(x), torch.arange(len(ids))[None])
    for h in hooks:
        h.remove()
    hd = cfg.hidden_size // cfg.num_attention_heads
    ks, vs = [], []
    for i in range(cfg.num_hidden_layers):
        k = seen[f"{i}.k_proj"].view(1, len(ids), -1, hd).transpose(1, 2)
        _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
        ks.append(k_rot[0].transpose(0, 1).reshape(len(ids), -1))
        vs.append(seen[f"{i}.v_proj"][0])
    return ks, vs


def _hf_kv_amax(path: Path, ids: list[int]) -> tuple[list[float], list[float]]:
    """Each layer's post-rotary K and V amax as HF transformers computes them."""
    ks, vs = hf_post_rotary_kv(path, ids)
    return [float(k.abs().max()) for k in ks], [float(v.abs().max()) for v in vs]


def test_calibration_gives_each_layer_its_amax_over_the_chat_text(tiny_llama) -> None:
    # Unrotated K/V: HF's amax is the pool's scale (rotated scales: tests/model_executor/test_kv_rotation.py).
    d = RunnerDriver(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_cache_rotation="none")
    pool = d.runner.token_to_kv_pool
    assert pool.scales.source == "calibrate" and pool.dtype == F8
    ids = KVCalibrator.calibration_ids(str(tiny_llama), d.runner.model_config.vocab_size, d.runner.context_len)
    assert ids[0] == 1 and len(ids) > 100  # the tiny tokenizer's chat template: <|im_start|> first
    k_amax, v_amax = _hf_kv_amax(tiny_llama, ids)
    want = KVScales.from_amax(k_amax, v_amax, CALIBRATION_HEADROOM)
    assert pool.k_scales == pytest.approx(want.k, rel=1e-4) and pool.v_scales == pytest.approx(want.v, rel=1e-4)
    assert pool.k_scales[0] != pool.k_scales[1] and pool.v_scales[0] != pool.v_scales[1]
    assert pool.k_scales[0] == pytest.approx(k_amax[0] * CALIBRATION_HEADROOM / FP8_E4M3_MAX)
    ref_toks, ref = greedy(RunnerDriver(tiny_llama))
    toks, got = greedy(d)
    assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())
    picked = ref.gather(1, got.argmax(-1, keepdim=True)).squeeze(1)  # near-ties of the random model aside
    assert bool((picked >= ref.amax(-1) - 0.05 * float(ref.abs().max())).all())


def test_static_scale_and_non_fp8_pools_skip_calibration(tiny_llama) -> None:
    static = RunnerDriver(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_cache_scale_mode="static").runner
    assert static.token_to_kv_pool.k_scales == (1.0, 1.0) and static.token_to_kv_pool.scales.source == "static"
    half = RunnerDriver(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_cache_scale=0.5).runner
    assert half.token_to_kv_pool.v_scales == (0.5, 0.5)
    plain = RunnerDriver(tiny_llama).runner
    assert plain.token_to_kv_pool.k_scales == (1.0, 1.0) and plain.token_to_kv_pool.scales.source == "static"


def test_pool_quantizes_each_layer_with_its_own_scale() -> None:
    scales = KVScales((0.5, 0.01), (0.25, 0.002), "checkpoint")
    pool = TokenToKVPool(8, 2, 2, 4, F8, "cpu", scales)
    x = torch.full((1, 8), 0.75)
    loc = torch.tensor([3])
    for layer in range(2):
        pool.set_kv(layer, loc, x, x)
    assert pool.k_buffers[0][3].float().unique().tolist() == [1.5]  # 0.75 / 0.5
    assert pool.k_buffers[1][3].float().unique().tolist() == [72.0]  # 75 rounded to e4m3
    assert pool.v_buffers[1][3].float().unique().tolist() == [384.0]  # 375 rounded to e4m3
    assert pool.layer_scales(1) == (0.01, 0.002)
    with pytest.raises(ValueError, match="for 2 layers given to a pool of 3"):
        TokenToKVPool(8, 3, 2, 4, F8, "cpu", scales)
    with pytest.raises(ValueError, match="layer 1's V scale must be a positive finite"):
        KVScales((1.0, 1.0), (1.0, 0.0))


def test_per_layer_scales_keep_tiny_v_and_huge_k_that_scale_1_loses(tiny_llama, tmp_path) -> None:
    """The same function with layer 0's V 1000x smaller (o_proj 1000x larger) and layer 1's K 1000x larger
    (q_proj 1000x smaller): with one scale of 1.0, V falls below e4m3's subnormals and K saturates at 448;
    calibrated per-layer scales keep both, and the logits stay those of the full-precision pool."""
    shutil.copytree(tiny_llama, tmp_path / "rescaled")
    path = tmp_path / "rescaled"
    w = load_file(str(path / "model.safetensors"))
    w["model.layers.0.self_attn.v_proj.weight"] *= 1e-3
    w["model.layers.0.self_attn.o_proj.weight"] *= 1e3
    w["model.layers.1.self_attn.k_proj.weight"] *= 1e3
    w["model.layers.1.self_attn.q_proj.weight"] *= 1e-3
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    _, ref = greedy(RunnerDriver(tiny_llama))
    _, same = greedy(RunnerDriver(path))  # the rescaled model in full precision: the same function
    assert float((same - ref).abs().max()) < 1e-3 * float(ref.abs().max())
    # Rotation off: the calibrated rotation would itself rebalance layer 1's K against its q.
    calibrated = RunnerDriver(path, kv_cache_dtype="fp8_e4m3", kv_cache_rotation="none")
    k, v = calibrated.runner.token_to_kv_pool.k_scales, calibrated.runner.token_to_kv_pool.v_scales
    assert v[0] < 1e-4 and k[1] > 0.5  # the layers' own ranges
    _, got = greedy(calibrated)
    _, static = greedy(RunnerDriver(path, kv_cache_dtype="fp8_e4m3", kv_cache_scale_mode="static"))
    err, static_err = float((got - ref).abs().max()), float((static - ref).abs().max())
    assert err < 0.05 * float(ref.abs().max()) and static_err > 5 * err, (err, static_err)
