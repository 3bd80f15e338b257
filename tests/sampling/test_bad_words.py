"""Bad words: the per-step bans equal a brute-force reference (a word's last id is banned exactly when the
output would end with the whole word; the prompt never counts, as in vLLM), greedy and seeded sampling
over many steps never complete one and pick what the brute-force-masked logits give, a token still
sampling on the device (overlap) matches any, verify rows ban per position with the drafts as output,
and the strings become token ids by vLLM's rule (as is, and after a space where that is another word
token of the same length), with clear errors naming bad_words."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from runtime.errors import InvalidRequestError
from runtime.layers.sampler import Sampler, bad_word_bans
from runtime.managers.req import Req
from runtime.managers.request_validation import RequestLimits, validate_request
from runtime.messages import GenerateRequest, SamplingBatch, SpecInfo
from runtime.sampling.params import SamplingParams
from runtime.speculative.verify_sampling import VerifySampling
from runtime.text.bad_words import tokenize_bad_words
from runtime.text.tokenizer import NullTokenizer, Tokenizer

V = 12  # a small vocabulary: random outputs run into the words often


def batch(n: int, **over: Any) -> SamplingBatch:
    base: dict[str, Any] = dict(
        temperatures=[1.0] * n, top_ps=[1.0] * n, top_ks=[-1] * n, min_ps=[0.0] * n, seeds=list(range(n)),
        steps=[0] * n, repetition_penalties=[1.0] * n, frequency_penalties=[0.0] * n,
        presence_penalties=[0.0] * n, penalty_tokens=[[] for _ in range(n)], prompt_lens=[0] * n,
        blocked_token_ids=[[] for _ in range(n)], top_logprobs_nums=[0] * n)
    return SamplingBatch(**{**base, **over})


def brute_bans(words: list[list[int]], output: list[int]) -> set[int]:
    """Every id t whose choice would make the output end with a whole bad word."""
    return {t for t in range(V) for w in words
            if len(w) <= len(output) + 1 and (output + [t])[len(output) + 1 - len(w):] == w}


def completes_a_word(words: list[list[int]], output: list[int]) -> bool:
    return any(output[i:i + len(w)] == w for w in words for i in range(len(output) - len(w) + 1))


def random_words(rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(V) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 5))]


def test_bans_equal_the_brute_force_reference():
    rng = random.Random(0)
    for _ in range(2000):
        words = random_words(rng)
        output = [rng.randrange(V) for _ in range(rng.randint(0, 6))]
        reach = max(map(len, words)) - 1
        context = output[-reach:] if reach else []
        assert set(bad_word_bans(words, context)) == brute_bans(words, output), (words, output)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_many_steps_never_complete_a_word_and_match_the_masked_reference(temperature):
    gen = torch.Generator().manual_seed(1)
    words = [[3], [5, 6], [7, 7, 8], [1, 2, 1, 2]]
    reach = max(map(len, words)) - 1
    # Step logits that favour the words' ids, so an unconstrained run would complete them again and again.
    bias = torch.zeros(V)
    bias[[1, 2, 3, 5, 6, 7, 8]] = 3.0
    bites = 0  # steps where a word of several tokens stopped what the unconstrained row would pick
    for row in range(4):
        output: list[int] = []
        for step in range(150):
            x = torch.randn(1, V, generator=gen) + bias
            plain = batch(1, temperatures=[temperature], seeds=[row], steps=[step])
            sb = batch(1, temperatures=[temperature], seeds=[row], steps=[step], bad_words_ids=[words],
                       bad_words_context=[output[-reach:]])
            got = int(Sampler()(x.clone(), sb).next_token_ids[0])
            masked = x.clone()
            masked[0, sorted(brute_bans(words, output))] = float("-inf")
            assert got == int(Sampler()(masked, plain).next_token_ids[0])
            bites += int(Sampler()(x.clone(), plain).next_token_ids[0]) in brute_bans(words[1:], output)
            output.append(got)
        assert not completes_a_word(words, output)
    assert bites >= 5


def test_the_prompt_never_completes_a_word():
    # vLLM matches the output only: at the first step, a word's prefix in the prompt bans nothing.
    assert bad_word_bans([[5, 6]], []) == []
    assert bad_word_bans([[5, 6], [9]], [5]) == [6, 9]


def test_req_context_is_the_outputs_tail_with_pending_tokens_as_wildcards():
    params = SamplingParams(bad_words_ids=[[1, 2, 3], [4]])
    req = Req("r", [9, 9, 9], params, 0, frozenset())
    assert req.bad_words_context() == []
    req.output_ids = [5, 1, 2]
    assert req.bad_words_context() == [1, 2]
    req.pending_tokens = 1  # overlap: the token after 2 is still on the device
    assert req.bad_words_context() == [2, -1]
    # [1, 2, 3] needs 1 then 2 before the 3: the known 2 is no 1, so 3 stays; a one-token word always goes.
    assert bad_word_bans(params.bad_words_ids, req.bad_words_context()) == [4]
    req.output_ids = [5, 6, 1]  # 1 then the unknown one, which may be the 2: 3 is banned (the safe side)
    assert bad_word_bans(params.bad_words_ids, req.bad_words_context()) == [3, 4]
    assert Req("s", [1], SamplingParams(bad_words_ids=[[4]]), 0, frozenset()).bad_words_context() == []
    assert params.needs_recent_output and not SamplingParams(bad_words_ids=[[4]]).needs_recent_output


def test_verify_rows_ban_per_position_with_the_drafts_as_output():
    torch.manual_seed(0)
    x = torch.randn(4, V) * 3
    words = [[5, 6], [6, 5, 4]]
    drafts = [[5, 6, 5]]
    sb = batch(1, temperatures=[0.0], steps=[3], bad_words_ids=[words], bad_words_context=[[1, 6]])
    spec = SpecInfo(num_drafts=[3])
    assert not VerifySampling.plain_greedy(sb, spec)
    rows = VerifySampling.expand(sb, spec, drafts)
    assert rows.bad_words_context == [[1, 6], [1, 6, 5], [1, 6, 5, 6], [1, 6, 5, 6, 5]]
    joint = Sampler()(x.clone(), rows).next_token_ids.tolist()
    output = [1, 6]
    for j in range(4):
        masked = x[j:j + 1].clone()
        masked[0, sorted(brute_bans(words, output + drafts[0][:j]))] = float("-inf")
        assert joint[j] == int(masked.argmax())
    allowed = batch(1, temperatures=[0.0], allowed_rows=[0], allowed_mask=(0b110).to_bytes(4, "little"))
    assert not VerifySampling.plain_greedy(allowed, spec)
    rows = VerifySampling.expand(allowed, spec, drafts)
    assert rows.allowed_rows == [0, 1, 2, 3] and rows.allowed_mask == (0b110).to_bytes(4, "little") * 4


class FakeTokenizer:
    """Splits on characters; a space merges into the next one only for the words in `merged`."""

    is_null = False

    def __init__(self, merged: set[str]):
        self.merged = merged

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        if text.startswith(" ") and text[1:] in self.merged:
            return [1000 + ord(text[1])] + [ord(c) for c in text[2:]]
        return [ord(c) for c in text]


def test_strings_become_ids_by_vllms_rule():
    tok = FakeTokenizer(merged={"ab"})
    p = tokenize_bad_words(SamplingParams(bad_words=["ab", "  cd", "ab"], bad_words_ids=[[1]]), tok)
    # "ab": as is, and " ab" (another first token, same length); "cd": leading spaces stripped, and " cd"
    # splits the space off (one token longer): only the plain form. The duplicate "ab" adds nothing.
    assert p.bad_words == [] and p.bad_words_ids == [[1], [97, 98], [1097, 98], [99, 100]]
    assert tokenize_bad_words(SamplingParams(), tok) == SamplingParams()


def test_a_real_tokenizer_bans_the_word_and_its_spaced_form(tiny_llama):
    tok = Tokenizer(tiny_llama)
    p = tokenize_bad_words(SamplingParams(bad_words=["fox"]), tok)
    plain, spaced = tok.encode("fox", add_special_tokens=False), tok.encode(" fox", add_special_tokens=False)
    assert spaced[0] != plain[0] and len(spaced) == len(plain)  # a byte-level BPE: " fox" is its own word
    assert p.bad_words_ids == [plain, spaced]


@pytest.mark.parametrize(("params", "tokenizer", "words"), [
    (SamplingParams(bad_words=["x"]), NullTokenizer(()), "needs a tokenizer"),
    (SamplingParams(bad_words=["x"] * 3), FakeTokenizer(set()), None),  # duplicates: one word, allowed
    (SamplingParams(bad_words=[f"w{i}" for i in range(100)]), FakeTokenizer({f"w{i}" for i in range(100)}),
     "at most 128"),
])
def test_tokenizing_errors_name_bad_words(params, tokenizer, words):
    if words is None:
        assert tokenize_bad_words(params, tokenizer).bad_words_ids == [[120]]
        return
    with pytest.raises(InvalidRequestError) as e:
        tokenize_bad_words(params, tokenizer)
    assert e.value.param == "bad_words" and words in e.value.message


@pytest.mark.parametrize(("given", "param", "words"), [
    ({"bad_words": [""]}, "bad_words", "non-blank"),
    ({"bad_words": ["  "]}, "bad_words", "non-blank"),
    ({"bad_words": ["x"] * 129}, "bad_words", "at most 128"),
    ({"bad_words": [5]}, "bad_words", "str"),
    ({"bad_words_ids": [[]]}, "bad_words_ids", "non-empty"),
    ({"bad_words_ids": [[1, -2]]}, "bad_words_ids", "each id"),
    ({"bad_words_ids": [[1] * 600, [2] * 600]}, "bad_words_ids", "1024 tokens"),
])
def test_bad_values_name_the_param(given, param, words):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict(given)
    assert e.value.param == param and words in e.value.message


def test_the_scheduler_refuses_untokenized_words_and_ids_outside_the_vocabulary():
    limits = RequestLimits(context_len=64, vocab_size=100, kv_size=64)
    with pytest.raises(InvalidRequestError) as e:
        validate_request(limits, GenerateRequest(rid="a", input_ids=[1], sampling_params=SamplingParams(
            bad_words=["x"])))
    assert e.value.param == "bad_words" and "token ids" in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        validate_request(limits, GenerateRequest(rid="b", input_ids=[1], sampling_params=SamplingParams(
            bad_words_ids=[[1, 100]])))
    assert e.value.param == "bad_words_ids" and "100" in e.value.message
