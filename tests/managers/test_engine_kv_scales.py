"""The Engine with per-layer FP8 KV scales (calibrated at start, or read from the checkpoint's k_scale /
v_scale tensors): chunked prefill, MIXED steps and radix-cache hits over the FP8 pool agree with HF
transformers' greedy tokens as the FP8 engine tests require, and the KV pool is whole afterwards."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randint(3, 399) for _ in range(40)]
    return [shared + [rng.randint(3, 399) for _ in range(rng.randint(5, 30))] for _ in range(6)]


@pytest.mark.parametrize("source", ["calibrate", "checkpoint"])
def test_engine_per_layer_kv_scales_agree_with_hf(make_engine, tiny_llama, tmp_path, hf_greedy, pool_full,
                                                   source: str) -> None:
    path = tiny_llama
    if source == "checkpoint":
        path = tmp_path / "ckpt"
        shutil.copytree(tiny_llama, path)
        weights = load_file(str(path / "model.safetensors"))
        for i, (ks, vs) in enumerate(((0.004, 0.003), (0.006, 0.002))):  # ~ amax * 2 / 448 of this model
            weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(ks)
            weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(vs)
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    engine = make_engine(path, kv_cache_dtype="fp8_e4m3", chunked_prefill_size=16, enable_mixed_chunk=True)
    pool = engine.worker.runner.token_to_kv_pool
    assert pool.is_fp8 and pool.scales.source == source
    if source == "checkpoint":
        assert pool.k_scales == pytest.approx((0.004, 0.006)) and pool.v_scales == pytest.approx((0.003, 0.002))
    prompts = _prompts()
    first = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    again = engine.generate(input_ids=prompts, sampling_params=GREEDY)  # prefixes now from the FP8 cache
    assert sum(o["usage"]["cached_tokens"] for o in again) >= 6 * 40
    want = [hf_greedy(p, 12) for p in prompts]
    got = [o["output_ids"] for o in first + again]
    assert all(len(ids) == 12 for ids in got)
    agree = sum(a == b for w, g in zip(want * 2, got, strict=True) for a, b in zip(w, g, strict=True))
    assert agree >= 0.8 * 12 * 12, agree  # random tiny weights have near-ties; the bench measures this
    pool_full(engine)
