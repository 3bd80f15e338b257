"""Prompt top-N logprobs (input_top_logprobs_num) through the in-process Engine: each prompt position after
the first lists its top N tokens as HF's fp32 log_softmax ranks them, whatever the chunked-prefill size,
whatever the prefix cache holds, and whatever else shares the batch."""

from __future__ import annotations

import asyncio

import pytest
import torch

from runtime.errors import InvalidRequestError

GREEDY = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
TEXT = "The quick brown fox jumps over the lazy dog. A second sentence follows it here."


@pytest.fixture(scope="module")
def hf_prompt_logprobs(hf_llama):
    """Row i: HF's log_softmax at prompt position i, the distribution of prompt token i + 1."""

    @torch.inference_mode()
    def run(prompt: list[int]) -> torch.Tensor:
        return torch.log_softmax(hf_llama(torch.tensor([prompt])).logits[0].float(), dim=-1)

    return run


def assert_matches_hf(out: dict, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    lps, tops = out["input_logprobs"], out["input_top_logprobs"]
    assert len(lps) == len(tops) == len(prompt) and lps[0] is None and tops[0] is None
    for i in range(1, len(prompt)):
        row = ref[i - 1]
        assert [t for t, _ in tops[i]] == row.topk(k).indices.tolist(), i
        for t, lp in tops[i]:
            assert lp == pytest.approx(float(row[t]), abs=1e-4)
        assert lps[i] == pytest.approx(float(row[prompt[i]]), abs=1e-4)


@pytest.mark.parametrize("chunk", [-1, 8])
def test_prompt_top_logprobs_match_hf_with_cache_and_chunks(make_engine, tiny_llama, hf_prompt_logprobs, chunk):
    engine = make_engine(tiny_llama, chunked_prefill_size=chunk)
    prompt = engine.tokenizer.encode(TEXT)
    assert len(prompt) > 2 * 8  # several chunks at chunk size 8
    ref = hf_prompt_logprobs(prompt)
    # Put the whole prompt, and a request sharing only its first half, into the prefix cache.
    engine.generate(input_ids=[prompt, prompt[:len(prompt) // 2] + [5, 6, 7]], sampling_params=GREEDY)
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert again["usage"]["cached_tokens"] > 0  # the cache really holds it

    out = engine.generate(input_ids=prompt, sampling_params=GREEDY, input_top_logprobs_num=4)
    assert out["usage"]["cached_tokens"] == 0  # a cached prefix has no logits: scored from scratch
    assert_matches_hf(out, prompt, ref, 4)
    assert out["output_ids"] == again["output_ids"]

    # Top N alone implies the prompt token's own logprob; asking both gives the same numbers.
    both = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_input_logprob=True,
                           input_top_logprobs_num=4)
    assert both["input_logprobs"][1:] == pytest.approx(out["input_logprobs"][1:], abs=1e-5)
    assert_matches_hf(both, prompt, ref, 4)


def test_prompt_top_logprobs_in_one_batch_differ_per_request(make_engine, tiny_llama, hf_prompt_logprobs):
    engine = make_engine(tiny_llama, chunked_prefill_size=8)
    long = engine.tokenizer.encode(TEXT)
    short = engine.tokenizer.encode("Hello world! How are you")
    plain = engine.tokenizer.encode("Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12")

    async def together():
        return await asyncio.gather(
            engine.async_generate(input_ids=plain, sampling_params={**GREEDY, "max_new_tokens": 6}),
            engine.async_generate(input_ids=long, sampling_params=GREEDY, input_top_logprobs_num=1),
            engine.async_generate(input_ids=short, sampling_params=GREEDY, input_top_logprobs_num=5),
            engine.async_generate(input_ids=short, sampling_params=GREEDY, return_input_logprob=True))

    p, a, b, c = asyncio.run(together())
    assert "input_logprobs" not in p and "input_top_logprobs" not in p
    assert_matches_hf(a, long, hf_prompt_logprobs(long), 1)
    assert_matches_hf(b, short, hf_prompt_logprobs(short), 5)
    assert "input_top_logprobs" not in c and c["input_logprobs"][1:] == pytest.approx(b["input_logprobs"][1:], abs=1e-5)


def test_one_token_prompt_has_no_positions_to_score(engine):
    out = engine.generate(input_ids=[5], sampling_params=GREEDY, input_top_logprobs_num=2)
    assert out["input_top_logprobs"] == [None] and out["input_logprobs"] == [None]
    assert len(out["output_ids"]) == 3


@pytest.mark.parametrize("n", [-1, 21, 2**63])
def test_out_of_range_top_n_is_refused(engine, n):
    with pytest.raises(InvalidRequestError) as ei:
        engine.generate("Hello", GREEDY, input_top_logprobs_num=n)
    assert ei.value.param == "input_top_logprobs_num" and str(n) in str(ei.value)
