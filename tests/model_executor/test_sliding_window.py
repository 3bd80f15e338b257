"""Sliding-window attention (Mistral's sliding_window; Qwen2's use_sliding_window from max_window_layers
on) reproduces HF transformers past the window, with the torch_native and Triton backends: prefill logits
and greedy decoding on the same tiny checkpoints, and through the Engine with chunked prefill and a
prefix-cache hit. The context is no longer capped at the window."""

from __future__ import annotations

import pytest
import torch
from runner_driver import RunnerDriver
from tiny_models import make_tokenizer
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from runtime.model_config import ModelConfig
from runtime.model_executor.forward_mode import ForwardMode

WINDOW = 5
PROMPT = [5, 17, 33, 101, 250, 7, 9, 300, 12, 12, 88, 64, 3, 200, 150, 99, 10, 11, 270, 42]
NEW_TOKENS = 12


def _config(arch: str, vocab: int, eos: int):
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  eos_token_id=eos, pad_token_id=0, tie_word_embeddings=False, rope_theta=10000.0)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=WINDOW)
    return Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def windowed(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"swa_{request.param}")
    tok = make_tokenizer(path)
    torch.manual_seed(0)
    cfg = _config(request.param, len(tok), tok.convert_tokens_to_ids("<|im_end|>"))
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def test_config_reads_which_layers_have_a_window(windowed):
    arch, path, _ = windowed
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.sliding_windows == ((WINDOW, WINDOW) if arch == "mistral" else (0, WINDOW))
    assert cfg.has_sliding_window


def test_hf_really_uses_the_window(windowed):
    arch, path, hf = windowed
    no_window = {"sliding_window": None} if arch == "mistral" else {
        "use_sliding_window": False, "layer_types": ["full_attention"] * 2}
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **no_window).eval()
    with torch.no_grad():
        a, b = hf(torch.tensor([PROMPT])).logits[0, -1], full(torch.tensor([PROMPT])).logits[0, -1]
    assert (a - b).abs().max() > 1e-3  # else the comparisons below would not test the window


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_prefill_and_greedy_decode_match_hf(windowed, backend):
    _, path, hf = windowed
    with torch.no_grad():
        ref_logits = hf(torch.tensor([PROMPT])).logits[0, -1]
        gen = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    d = RunnerDriver(path, attention_backend=backend, context_length=256)
    assert d.runner.context_len == 256  # not capped at the window any more
    row = d.new_row()
    _, out = d.step(ForwardMode.EXTEND, [row], [PROMPT])
    logits = out.next_token_logits[0]
    assert (logits - ref_logits).abs().max().item() / ref_logits.abs().max().item() < 1e-4
    produced = [int(logits.argmax())]
    for _ in range(NEW_TOKENS - 1):
        _, out = d.step(ForwardMode.DECODE, [row], [[produced[-1]]])
        produced.append(int(out.next_token_logits[0].argmax()))
    assert produced == gen


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_engine_chunked_prefill_and_prefix_hit_match_hf(windowed, backend):
    from runtime import Engine

    _, path, hf = windowed
    with torch.no_grad():
        gen = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    # 3-token chunks: every chunk after the first attends over a cached prefix through the window.
    with Engine(str(path), device="cpu", dtype="float32", chunked_prefill_size=3, max_total_tokens=1024,
                attention_backend=backend) as engine:
        first = engine.generate(input_ids=PROMPT, sampling_params=params)
        again = engine.generate(input_ids=PROMPT, sampling_params=params)  # the prompt is now cached
    assert first["output_ids"] == gen
    assert again["output_ids"] == gen and again["usage"]["cached_tokens"] > 0
