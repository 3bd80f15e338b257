"""allowed_token_ids and bad words through the Engine on the tiny Llama, plain and with NGRAM speculative
decoding: greedy outputs equal HF's greedy loop under its own logits processors (PrefixConstrained for the
allowed ids, NoBadWords for the words), seeded sampling gives the same tokens with and without
speculation, bad_words strings ban what their token ids ban, and logprobs stay the raw model's."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from runtime import Engine
from runtime.sampling.params import SamplingParams
from runtime.text.bad_words import tokenize_bad_words

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 16}
TEXTS = ["Hello world", "The capital of France is", "def forward(self, x):"]


@pytest.fixture(scope="module")
def engines(tiny_llama) -> Iterator[dict[str, Engine]]:
    kw = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096, "log_level": "warning"}
    plain = Engine(str(tiny_llama), **kw)
    ngram = Engine(str(tiny_llama), **kw, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    yield {"plain": plain, "ngram": ngram}
    plain.shutdown()
    ngram.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(engines) -> list[list[int]]:
    return [engines["plain"].tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def free(engines, prompts) -> list[list[int]]:
    """The unconstrained greedy outputs."""
    return [o["output_ids"] for o in engines["plain"].generate(input_ids=prompts, sampling_params=GREEDY)]


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], n: int, processor: Callable) -> tuple[list[int], list[float]]:
    """HF's greedy tokens under `processor`, and each one's logprob under the raw logits."""
    ids, lps = list(prompt), []
    for _ in range(n):
        raw = hf(torch.tensor([ids])).logits[:, -1]
        t = int(processor(torch.tensor([ids]), raw.clone()).argmax())
        lps.append(float(torch.log_softmax(raw[0], dim=-1)[t]))
        ids.append(t)
    return ids[len(prompt):], lps


def contains(output: list[int], word: list[int]) -> bool:
    return any(output[i:i + len(word)] == word for i in range(len(output) - len(word) + 1))


@pytest.mark.parametrize("which", ["plain", "ngram"])
def test_greedy_allowed_ids_equal_hf(engines, hf, prompts, free, which):
    from transformers import PrefixConstrainedLogitsProcessor

    # Some of each output's own tokens but never its first: the constraint bites at once.
    allowed = [sorted({*out[1:5], 5, 17, 33} - {out[0]}) for out in free]
    params = [{**GREEDY, "allowed_token_ids": a, "return_logprob": which == "plain"} for a in allowed]
    outs = engines[which].generate(input_ids=prompts, sampling_params=params)
    for prompt, a, o in zip(prompts, allowed, outs):
        want, lps = hf_greedy(hf, prompt, 16, PrefixConstrainedLogitsProcessor(lambda b, ids, a=a: a, num_beams=1))
        assert o["output_ids"] == want and set(want) <= set(a)
        if which == "plain":  # the raw distribution's logprob of each chosen token, as without the mask
            assert o["logprobs"] == pytest.approx(lps, abs=1e-4)


@pytest.mark.parametrize("which", ["plain", "ngram"])
def test_greedy_bad_words_equal_hf(engines, hf, prompts, free, which):
    from transformers import NoBadWordsLogitsProcessor

    params, words_of = [], []
    for prompt, out in zip(prompts, free):
        # Words the free output completes; none starting with a prompt token, since HF's processor matches
        # the prompt too and vLLM's rule (and ours) the output only.
        cands = [out[i:i + n] for n in (2, 3) for i in range(len(out) - n + 1) if out[i] not in prompt]
        words = [cands[0], cands[-1], [out[-1]]] if out[-1] not in prompt else [cands[0], cands[-1]]
        assert all(contains(out, w) for w in words)
        words_of.append(words)
        params.append({**GREEDY, "bad_words_ids": words})
    outs = engines[which].generate(input_ids=prompts, sampling_params=params)
    for prompt, words, o in zip(prompts, words_of, outs):
        want, _ = hf_greedy(hf, prompt, 16, NoBadWordsLogitsProcessor(words))
        assert o["output_ids"] == want
        assert not any(contains(want, w) for w in words)


def test_seeded_sampling_is_the_same_with_speculation(engines, prompts, free):
    words = [out[2:4] for out in free]
    params = [{"temperature": 0.8, "seed": 11 + i, "max_new_tokens": 24, "ignore_eos": True,
               "allowed_token_ids": sorted(set(free[i])), "bad_words_ids": [words[i]]} for i in range(len(free))]
    plain = engines["plain"].generate(input_ids=prompts, sampling_params=params)
    ngram = engines["ngram"].generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in plain] == [o["output_ids"] for o in ngram]
    for p, o in zip(params, plain):
        assert set(o["output_ids"]) <= set(p["allowed_token_ids"]) and not contains(o["output_ids"], p["bad_words_ids"][0])
    assert engines["ngram"].get_stats().spec_verify_reqs > 0  # the verify path did run, with these rows


def test_bad_words_strings_ban_their_token_ids(engines, prompts, free):
    e = engines["plain"]
    tok = e.tokenizer
    # A window of the free output whose text tokenizes back to the same ids (BPE need not round-trip).
    word = next(tok.decode(out[i:i + 2]) for out in free for i in range(len(out) - 1)
                if tok.encode(tok.decode(out[i:i + 2]).lstrip(), add_special_tokens=False) == out[i:i + 2])
    ids = tokenize_bad_words(SamplingParams(bad_words=[word]), tok).bad_words_ids
    by_text = e.generate(input_ids=prompts, sampling_params={**GREEDY, "bad_words": [word]})
    by_ids = e.generate(input_ids=prompts, sampling_params={**GREEDY, "bad_words_ids": ids})
    assert [o["output_ids"] for o in by_text] == [o["output_ids"] for o in by_ids]
    assert any(contains(out, ids[0]) for out in free)
    assert not any(contains(o["output_ids"], w) for o in by_text for w in ids)
    req = e.make_request(input_ids=prompts[0], sampling_params={"bad_words": [word]})
    assert req.sampling_params.bad_words == [] and req.sampling_params.bad_words_ids == ids



def overlapped(engine: Engine, **kw) -> list[int]:
    """One greedy run with overlap scheduling forced on (on CPU the launch is synchronous, but the tokens
    in flight are bookkept as on a GPU: the scheduler builds each step before it sees the last token)."""
    s = engine.scheduler
    with s.lock:
        s.overlap = True
    try:
        return engine.generate(**kw)["output_ids"]
    finally:
        with s.lock:
            s.overlap = False


def test_overlap_never_completes_a_word(engines, prompts, free):
    e = engines["plain"]
    outs = [overlapped(e, input_ids=p, sampling_params={**GREEDY, "bad_words_ids": [f[2:4], f[5:8]]})
            for p, f in zip(prompts, free)]
    assert not any(contains(o, w) for o, f in zip(outs, free) for w in (f[2:4], f[5:8]))


def test_overlap_bans_what_the_plain_loop_bans(engines, prompts, free):
    e = engines["plain"]
    out, ref = free[0], prompts[0]
    x = next(t for t in range(3, 400) if t not in out and t not in ref)  # never emitted: [x, out[5]] never bites
    params = {**GREEDY, "bad_words_ids": [[x, out[5]]]}
    assert e.generate(input_ids=ref, sampling_params=params)["output_ids"] == out
    assert overlapped(e, input_ids=ref, sampling_params=params) == out
