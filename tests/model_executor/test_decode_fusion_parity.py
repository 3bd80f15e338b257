"""The decode fusions end to end on CPU: the fused path (rotary + KV store kernel, pre-stored K/V, the
one-launch Triton decode attention, no logits gather) forced on in the Triton interpreter with the
Triton backend, against HF transformers' greedy generation on the tiny checkpoints and against the
unfused path bit for bit (fp32; an FP8 KV pool too). On the GPU: tests/gpu/test_decode_fusion_gpu.py."""

from __future__ import annotations

import pytest
import torch
from runner_driver import RunnerDriver
from transformers import AutoModelForCausalLM

from kernels.rotary import apply_rotary
from runtime.layers.attention import Attention
from runtime.layers.rotary import RotaryEmbedding
from runtime.model_executor.forward_mode import ForwardMode

PROMPTS = [[5, 17, 33, 101, 250, 7, 9], [42], [300, 12, 12, 12, 88, 64, 3, 200, 150, 99, 10, 11, 270]]
NEW_TOKENS = 6


def _cuda_rotary(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's code path on CPU: the kernels in the Triton interpreter, the unfused rotary too (CUDA's
    in-place kernel, whose explicit FMAs round unlike torch's two products)."""
    def rotary_in_place(self, positions, q, k):
        apply_rotary(positions, q, k, self.cos_sin_cache, self.head_dim, is_neox=True)
        return q, k

    monkeypatch.setattr(Attention, "_kernel_device", staticmethod(lambda q: True))
    monkeypatch.setattr(RotaryEmbedding, "forward", rotary_in_place)


def _greedy(path, fusion: str, monkeypatch: pytest.MonkeyPatch, **args) -> tuple[list[list[int]], list[torch.Tensor]]:
    monkeypatch.setenv("SHOAL_DECODE_FUSION", fusion)  # read as the layers are built
    d = RunnerDriver(path, attention_backend="triton", **args)
    pool = d.runner.token_to_kv_pool
    if pool.is_fp8 and "kv_cache_scale" not in args:  # calibrated: each layer its own, none of them 1.0
        assert len(set(pool.k_scales + pool.v_scales)) == 4 and 1.0 not in pool.k_scales
    rows = [d.new_row() for _ in PROMPTS]
    _, out = d.step(ForwardMode.EXTEND, rows, PROMPTS)
    produced = [[t] for t in out.next_token_logits.argmax(-1).tolist()]
    logits = []
    for _ in range(NEW_TOKENS - 1):
        _, out = d.step(ForwardMode.DECODE, rows, [[toks[-1]] for toks in produced])
        logits.append(out.next_token_logits)
        for toks, t in zip(produced, out.next_token_logits.argmax(-1).tolist()):
            toks.append(t)
    return produced, logits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_decode_matches_hf_and_unfused(tiny_model_dirs, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_model_dirs[arch]
    _cuda_rotary(monkeypatch)
    fused, fused_logits = _greedy(path, "1", monkeypatch)
    unfused, unfused_logits = _greedy(path, "0", monkeypatch)
    assert fused == unfused
    assert all(torch.equal(a, b) for a, b in zip(fused_logits, unfused_logits))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, ours in zip(PROMPTS, fused):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert ours == gen[0, len(prompt):].tolist(), arch


@pytest.mark.parametrize("scales", [{"kv_cache_scale": 0.5}, {}], ids=["static", "per_layer_calibrated"])
def test_fused_decode_fp8_pool_equals_unfused(tiny_model_dirs, monkeypatch: pytest.MonkeyPatch, scales) -> None:
    """Every Triton kernel (store, rotary + store, extend, decode) gets each layer's own scales."""
    _cuda_rotary(monkeypatch)
    path = tiny_model_dirs["llama"]
    fused, fused_logits = _greedy(path, "1", monkeypatch, kv_cache_dtype="fp8_e4m3", **scales)
    unfused, unfused_logits = _greedy(path, "0", monkeypatch, kv_cache_dtype="fp8_e4m3", **scales)
    assert fused == unfused
    assert all(torch.equal(a, b) for a, b in zip(fused_logits, unfused_logits))
