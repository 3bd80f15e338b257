"""Per-layer FP8 KV scales on the GPU, through every kernel that takes them (Triton store / rotary + store /
extend / decode, FlashInfer's k_scale / v_scale), CUDA graphs on: a Llama whose layer 0 V is 1024x smaller
(o_proj 1024x larger) and layer 1 K 1024x larger (q_proj 1024x smaller) computes the same function
(powers of two: exact in bf16). With one scale of 1.0 its V falls below e4m3's subnormals and its K
saturates at 448; with calibrated per-layer scales the prompt logprobs and greedy tokens stay those of
the bf16 pool. Every request completes and the KV pool is whole afterwards. The KV rotation is off here
(--kv-cache-rotation none): the calibrated one would rebalance layer 1's K against its q by itself
(tests/gpu/test_gpu_kv_rotation.py covers it)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from attention_cases import BACKENDS
from gpu_models import LLAMA_4L

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

MODEL = LLAMA_4L
RESCALE = 1024.0


def write_models(root: Path, device: str) -> tuple[Path, Path]:
    """(the model, its rescaled copy): the same function, layer 0's V and layer 1's K far from 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**MODEL)).to(torch.bfloat16)
    model.save_pretrained(root / "plain")
    layers = model.model.layers
    with torch.no_grad():
        layers[0].self_attn.v_proj.weight.mul_(1 / RESCALE)
        layers[0].self_attn.o_proj.weight.mul_(RESCALE)
        layers[1].self_attn.k_proj.weight.mul_(RESCALE)
        layers[1].self_attn.q_proj.weight.mul_(1 / RESCALE)
    model.save_pretrained(root / "rescaled")
    return root / "plain", root / "rescaled"


def run(path: Path, prompts: list[list[int]], **extra) -> tuple[list[list[int]], torch.Tensor, dict]:
    from runtime import Engine

    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=str(path), dtype="bfloat16", max_total_tokens=32768, cuda_graph_max_bs=32,
                context_length=1024, disable_radix_cache=True, **extra) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_input_logprob=True)
        pool = engine.worker.runner.token_to_kv_pool
        scales = {"source": pool.scales.source, "k": pool.k_scales, "v": pool.v_scales}
        assert engine.get_stats().num_used_tokens == 0
    assert all(len(o["output_ids"]) == 16 for o in outs)
    lps = torch.tensor([x for o in outs for x in o["input_logprobs"] if x is not None])
    return [o["output_ids"] for o in outs], lps, scales


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_layer_scales_through_gpu_kernels(tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prompt logprobs see FP8 only where the prefill reads the prompt's K/V back from the pool: flashinfer's
    # ragged prefill (its default) takes them as computed, and every error below read 0.0 with it (H200,
    # 2026-11-28). Its paged prefill reads them from the pool; DECODE reads the pool either way.
    monkeypatch.setenv("SHOAL_PREFILL_RAGGED", "0")
    plain, rescaled = write_models(tmp_path, "cuda")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randrange(16, 300))] for _ in range(16)]
    ref_tokens, ref_lp, _ = run(plain, prompts, attention_backend=backend)
    same_tokens, same_lp, _ = run(rescaled, prompts, attention_backend=backend)
    cal_tokens, cal_lp, cal = run(rescaled, prompts, attention_backend=backend, kv_cache_dtype="fp8_e4m3",
                                  kv_cache_rotation="none")
    fp8_tokens, fp8_lp, _ = run(plain, prompts, attention_backend=backend, kv_cache_dtype="fp8_e4m3",
                                kv_cache_rotation="none")
    _, static_lp, static = run(rescaled, prompts, attention_backend=backend, kv_cache_dtype="fp8_e4m3",
                               kv_cache_scale_mode="static")
    assert cal["source"] == "calibrate" and static["k"] == (1.0,) * 4
    assert cal["v"][0] < cal["v"][2] / 100 and cal["k"][1] > cal["k"][2] * 100  # each layer's own range
    diff = {name: float((lp - ref_lp).abs().mean()) for name, lp in
            (("rescaled_bf16", same_lp), ("rescaled_fp8_calibrated", cal_lp), ("plain_fp8", fp8_lp),
             ("rescaled_fp8_static_1", static_lp))}
    # Calibrated scales make the rescaled model's FP8 error that of the plain model's; 1.0 does not.
    assert diff["rescaled_fp8_calibrated"] < 2 * diff["plain_fp8"] + diff["rescaled_bf16"], diff
    assert diff["rescaled_fp8_static_1"] > 5 * diff["rescaled_fp8_calibrated"], diff
    agree = sum(a[0] == b[0] for a, b in zip(ref_tokens, cal_tokens, strict=True))
    assert agree >= 12, (agree, diff)  # as test_gpu_fp8's engine test: near-ties of random weights aside
