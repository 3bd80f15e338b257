"""Where FP8 KV's top-1 loss comes from, on the embedded SmolLM2 (CPU, teacher-forced as
bench_fp8_accuracy: the bf16 reference's 64 greedy tokens fed to each variant, agreement and mean
|logprob diff| per position).

Each variant runs a bf16 pool and rounds K and/or V through float8_e4m3fn (x / s, saturated, times s) as
they are stored, on chosen layers: K only, V only, layer 0 only, all layers with per-layer calibrated
scales (what --kv-cache-dtype fp8_e4m3 stores), with scale 1/64 (saturation), and K rotated by a 64x64
Hadamard matrix before rounding (its error spread over all channels; rotated back, so q.k is what the
rotated Q would see). Also each layer's post-rotary K/V amax and the share of |x| < 2^-6 (e4m3's
smallest normal, where scale 1.0 makes values subnormal) over the same prompts.

    python -m benchmarks.bench_fp8_kv_error_sources --output-file benchmarks/results/fp8_kv_error_sources_cpu.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_fp8_accuracy import ForcedDecoder, build_prompts
from benchmarks.common import print_table, write_result

F8 = torch.float8_e4m3fn
SMALLEST_NORMAL = 2.0 ** -6


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def _round_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return ((x.float() / scale).clamp(-448.0, 448.0).to(F8).float() * scale).to(x.dtype)


class KVRounding:
    """Wraps AttentionBackend.forward: rounds the new K/V per `variant` before the backend stores them."""

    def __init__(self, num_layers: int, head_dim: int):
        self.variant: dict[str, Any] = {}
        self.k_scales = self.v_scales = [1.0] * num_layers
        self.had = _hadamard(head_dim)
        self.stats: dict[int, dict[str, float]] = {}

    def __call__(self, orig: Any, backend: Any, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 layer: Any, fb: Any) -> torch.Tensor:
        i, var = layer.layer_id, self.variant
        if k is not None and var.get("stats"):
            s = self.stats.setdefault(i, {"k_amax": 0.0, "v_amax": 0.0, "k_small": 0, "v_small": 0, "n": 0})
            s["k_amax"] = max(s["k_amax"], float(k.abs().max()))
            s["v_amax"] = max(s["v_amax"], float(v.abs().max()))
            s["k_small"] += int((k.abs() < SMALLEST_NORMAL).sum())
            s["v_small"] += int((v.abs() < SMALLEST_NORMAL).sum())
            s["n"] += k.numel()
        if k is not None and i in var.get("layers", ()):
            ks, vs = (self.k_scales[i], self.v_scales[i]) if var.get("calibrated") else (var["scale"],) * 2
            if var.get("k"):
                if var.get("hadamard"):
                    t, d = k.shape[0], self.had.shape[0]
                    rot = (k.float().view(t, -1, d) @ self.had).to(k.dtype)
                    k = (_round_fp8(rot, ks).float() @ self.had.T).reshape(t, -1).to(k.dtype)
                else:
                    k = _round_fp8(k, ks)
            if var.get("v"):
                v = _round_fp8(v, vs)
        return orig(backend, q, k, v, layer, fb)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from runtime.attention.base import AttentionBackend
    from runtime.default_model import ensure_default_model

    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = args.model_path or str(ensure_default_model())
    prompts = build_prompts(model, args.num_prompts)
    kv_tokens = sum(len(p) + args.gen_len for p in prompts) + 16
    # The per-layer scales --kv-cache-dtype fp8_e4m3 calibrates (read from a real FP8 runner).
    fp8 = ForcedDecoder(model, "cpu", "bfloat16", 64, kv_cache_dtype="fp8_e4m3")
    pool = fp8.runner.token_to_kv_pool
    n_layers, head_dim = len(pool.k_scales), pool.k_buffers[0].shape[2]
    rounding = KVRounding(n_layers, head_dim)
    rounding.k_scales, rounding.v_scales = list(pool.k_scales), list(pool.v_scales)
    fp8.close()
    orig = AttentionBackend.forward
    AttentionBackend.forward = lambda self, q, k, v, layer, fb: rounding(orig, self, q, k, v, layer, fb)
    every = set(range(n_layers))
    variants = {
        "fp8_k_and_v_calibrated": {"k": True, "v": True, "layers": every, "calibrated": True},
        "fp8_k_and_v_scale_1": {"k": True, "v": True, "layers": every, "scale": 1.0},
        "fp8_k_only": {"k": True, "layers": every, "calibrated": True},
        "fp8_v_only": {"v": True, "layers": every, "calibrated": True},
        "fp8_layer0_only": {"k": True, "v": True, "layers": {0}, "calibrated": True},
        "fp8_not_layer0": {"k": True, "v": True, "layers": every - {0}, "calibrated": True},
        "fp8_scale_1/64_saturating": {"k": True, "v": True, "layers": every, "scale": 1 / 64},
        "fp8_k_hadamard_rotated": {"k": True, "v": True, "layers": every, "calibrated": True, "hadamard": True},
    }
    try:
        rounding.variant = {"stats": True}
        dec = ForcedDecoder(model, "cpu", "bfloat16", kv_tokens)
        ref, ref_lp = dec.run(prompts, args.gen_len, None)
        dec.close()
        out: dict[str, Any] = {"model": Path(model).name, "prompts": len(prompts), "gen_len": args.gen_len,
                               "calibrated_scales": {"k": rounding.k_scales, "v": rounding.v_scales},
                               "layers": {i: {"k_amax": s["k_amax"], "v_amax": s["v_amax"],
                                              "k_share_below_2^-6": s["k_small"] / s["n"],
                                              "v_share_below_2^-6": s["v_small"] / s["n"]}
                                          for i, s in sorted(rounding.stats.items())},
                               "variants": {}}
        for name, var in variants.items():
            rounding.variant = var
            dec = ForcedDecoder(model, "cpu", "bfloat16", kv_tokens)
            top, lp = dec.run(prompts, args.gen_len, ref)
            dec.close()
            out["variants"][name] = {"top1_agreement": float((top == ref).float().mean()),
                                     "mean_abs_logprob_diff": float((lp - ref_lp).abs().mean())}
            print(f"{name}: {out['variants'][name]}", flush=True)
    finally:
        AttentionBackend.forward = orig
    print_table("FP8 KV error sources (top-1 / mean |dlogp|)",
                [(k, f"{v['top1_agreement']:.4f} / {v['mean_abs_logprob_diff']:.4f}") for k, v in out["variants"].items()])
    if args.output_file:
        write_result(args.output_file, "fp8_kv_error_sources", out, vars(args),
                     argv=sys.argv if argv is None else ["bench_fp8_kv_error_sources.py", *argv])
    return out


if __name__ == "__main__":
    main()
