"""allowed_token_ids, bad words and prompt logprobs on the GPU path as users run it: bf16, CUDA graphs and
overlap scheduling on (the GPU defaults). Masks must leave an allowed argmax where it was (the same graph,
the same row, so bit-equal logits), a bad word must never be completed and nothing before it may change
(overlap collects the step in flight for a multi-token word), and prompt logprobs match HF's bf16 ones."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gpu_models import LLAMA_4L, save_bf16_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

GREEDY = {"max_new_tokens": 96, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def gpu_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_bf16_llama(tmp_path_factory.mktemp("gpu_llama_constraints"), LLAMA_4L)


@pytest.fixture(scope="module")
def engine(gpu_llama: Path) -> Iterator:
    from runtime import Engine

    # No radix cache: a cached prefix runs other kernels, whose bf16 rounding may flip a random model's near-ties.
    e = Engine(str(gpu_llama), dtype="bfloat16", max_total_tokens=32768, context_length=2048, cuda_graph_max_bs=16,
               disable_radix_cache=True)
    assert e.scheduler.overlap, "the GPU default is overlap scheduling: the test is about that path"
    try:
        yield e
    finally:
        e.shutdown()
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, LLAMA_4L["vocab_size"], (n,), generator=g).tolist() for n in (17, 120, 301)]


@pytest.fixture(scope="module")
def free(engine, prompts) -> list[list[int]]:
    return [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]


def test_allowed_superset_keeps_the_greedy_output(engine, prompts, free) -> None:
    for p, out in zip(prompts, free, strict=True):
        allowed = sorted(set(out) | {5, 6, 7})
        got = engine.generate(input_ids=p, sampling_params={**GREEDY, "allowed_token_ids": allowed})["output_ids"]
        assert got == out


def test_allowed_subset_samples_only_allowed(engine, prompts, free) -> None:
    for p, out in zip(prompts, free, strict=True):
        allowed = sorted(set(out[1:]) - {out[0]})[:8] or [5]
        got = engine.generate(input_ids=p, sampling_params={**GREEDY, "allowed_token_ids": allowed})["output_ids"]
        assert set(got) <= set(allowed) and len(got) == GREEDY["max_new_tokens"]
        sampled = engine.generate(input_ids=p, sampling_params={**GREEDY, "temperature": 1.0, "seed": 3,
                                                                  "allowed_token_ids": allowed})["output_ids"]
        assert set(sampled) <= set(allowed)


def _word_to_ban(out: list[int]) -> int:
    """A position k whose pair (out[k], out[k+1]) is new there, preferring one whose second token also came
    earlier: a ban wider than the word (the step in flight taken as matching) would change that earlier token."""
    firsts = [k for k in range(1, len(out) - 1)
              if (out[k], out[k + 1]) not in set(zip(out[:k], out[1:k + 1])) and out[k + 1] in out[1:k]]
    return firsts[0] if firsts else len(out) // 2


def test_bad_word_never_completed_and_nothing_before_changes(engine, prompts, free) -> None:
    for p, out in zip(prompts, free, strict=True):
        k = _word_to_ban(out)
        word = out[k:k + 2]
        got = engine.generate(input_ids=p, sampling_params={**GREEDY, "bad_words_ids": [word]})["output_ids"]
        assert got[:k + 1] == out[:k + 1]
        assert got[k + 1] != out[k + 1]
        assert not any(got[i:i + 2] == word for i in range(len(got) - 1))
        single = engine.generate(input_ids=p, sampling_params={**GREEDY, "bad_words_ids": [[out[0]]]})["output_ids"]
        assert out[0] not in single


def test_prompt_logprobs_match_hf_bf16(engine, gpu_llama: Path, prompts) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gpu_llama, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    try:
        for p in prompts:
            res = engine.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 1},
                                  return_input_logprob=True, input_top_logprobs_num=3)
            with torch.inference_mode():
                ref = hf(torch.tensor([p], device="cuda")).logits[0, :-1].float().log_softmax(-1)
            want = ref.gather(1, torch.tensor(p[1:], device="cuda")[:, None]).squeeze(1).cpu()
            ours = torch.tensor(res["input_logprobs"][1:], dtype=torch.float32)
            assert res["input_logprobs"][0] is None
            assert (ours - want).abs().max() < 0.1  # bf16 logits of two implementations
            tops = [t for t in res["input_top_logprobs"][1:]]
            assert all(len(t) == 3 for t in tops)
            top1 = torch.tensor([t[0][1] for t in tops])
            assert (top1 - ref.max(-1).values.cpu()).abs().max() < 0.1
    finally:
        del hf
        gc.collect()
        torch.cuda.empty_cache()
