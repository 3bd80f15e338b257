"""Mixtral, Qwen2-MoE (shared expert, dense layers by decoder_sparse_step and mlp_only_layers) and Qwen3-MoE
reproduce HF transformers on the same tiny fp32 checkpoints: prefill logits, batched greedy decoding through
the ModelRunner (EXTEND, then DECODE steps) and greedy generation through runtime.Engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from moe_tiny import MOE_ARCHS, make_tiny_moe
from transformers import AutoModelForCausalLM

from runtime.layers.fused_moe import FusedMoE
from runtime.model_executor.forward_mode import ForwardMode
from runtime.models.moe_block import SparseMoeBlock

sys.path.insert(0, str(Path(__file__).parents[1] / "model_executor"))
from runner_driver import RunnerDriver  # noqa: E402

PROMPTS = [[5, 17, 33, 101, 250, 7, 9], [42], [300, 12, 12, 12, 88, 64, 3, 200, 150, 99, 10, 11, 270]]
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe(request, tmp_path_factory):
    path = make_tiny_moe(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return gen[0, len(prompt):].tolist()


def test_layers_are_sparse_or_dense_as_hf(moe) -> None:
    arch, path, hf = moe
    d = RunnerDriver(path, max_total_tokens=512)
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in d.runner.model.model.layers]
    theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert ours == theirs and any(ours), arch
    assert all(isinstance(m.experts, FusedMoE) for m in d.runner.model.modules() if isinstance(m, SparseMoeBlock))


def test_prefill_and_batched_decode_match_hf(moe) -> None:
    arch, path, hf = moe
    d = RunnerDriver(path, max_total_tokens=1024)
    rows = [d.new_row() for _ in PROMPTS]
    _, out = d.step(ForwardMode.EXTEND, rows, PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1]
        err = (out.next_token_logits[i] - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-4, f"{arch}: prefill logits of prompt {i} differ by {err:.2e} (relative)"
    produced = [[t] for t in out.next_token_logits.argmax(-1).tolist()]
    for _ in range(NEW_TOKENS - 1):
        _, out = d.step(ForwardMode.DECODE, rows, [[toks[-1]] for toks in produced])
        for toks, t in zip(produced, out.next_token_logits.argmax(-1).tolist()):
            toks.append(t)
    for i, prompt in enumerate(PROMPTS):
        assert produced[i] == _hf_greedy(hf, prompt), f"{arch}: prompt {i} decodes differently from HF"


def test_engine_greedy_matches_hf_generate(moe) -> None:
    from runtime import Engine

    arch, path, hf = moe
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with Engine(str(path), device="cpu", dtype="float32", max_total_tokens=1024) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        assert out["output_ids"] == _hf_greedy(hf, prompt), f"{arch}: Engine output {i} differs from HF"
