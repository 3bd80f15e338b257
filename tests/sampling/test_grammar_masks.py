"""Grammar masks as Shoal compiles them: a length-bounded JSON string compiled as a rule chain allows,
at every step of random walks, exactly the tokens xgrammar's own repetition form allows (bit for bit,
over a vocabulary of multi-byte pieces with quotes, escapes and non-ASCII); and the batch's masks filled
on xgrammar's threads equal the row-by-row fill."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from structured_schemas import SCHEMAS

from runtime.sampling.bounded_strings import expand_bounded_strings
from runtime.sampling.grammar_compiler import GrammarCompiler, _no_control_chars, json_schema_ebnf

xgr = pytest.importorskip("xgrammar")

BOUNDED = {
    "min_max": {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 6},
                                                 "t": {"type": "string", "maxLength": 1}}, "required": ["s", "t"]},
    "array": {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 3}, "maxItems": 3},
    **{k: SCHEMAS[k] for k in ("person", "bounded_array")},
}


def _vocab(size: int = 600, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    vocab = [bytes([i]) for i in range(256)]
    alphabet = ['a', 'b', 'z', ' ', '"', '\\', ',', ':', '{', '}', '[', ']', '1', 'é', '√', '\n', 'n', 'u']
    seen = set(vocab)
    while len(vocab) < size:
        b = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 9))).encode()
        if b not in seen:
            seen.add(b)
            vocab.append(b)
    return vocab + [b"</s>"]  # the stop token, last


@pytest.fixture(scope="module")
def compiler():
    vocab = _vocab()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[len(vocab) - 1])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False), len(vocab)


def _bits(mask: torch.Tensor, vocab: int) -> np.ndarray:
    """Token t's allowed flag (the padding bits past the vocabulary are left as they come)."""
    return np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:vocab]


def _allowed(mask: torch.Tensor, vocab: int) -> np.ndarray:
    return np.nonzero(_bits(mask, vocab))[0]


@pytest.mark.parametrize("name", list(BOUNDED))
def test_rule_chain_masks_equal_xgrammar_repetition(compiler, name):
    comp, vocab = compiler
    ebnf = _no_control_chars(str(xgr.Grammar.from_json_schema(json.dumps(BOUNDED[name]), any_whitespace=False,
                                                              strict_mode=True)))
    expanded = expand_bounded_strings(ebnf)
    assert expanded != ebnf and "_len_" in expanded
    ref_g, ours_g = comp.compile_grammar(ebnf), comp.compile_grammar(expanded)
    words = (vocab + 31) // 32
    for walk in range(12):
        rng = random.Random(walk)
        ref, ours = xgr.GrammarMatcher(ref_g), xgr.GrammarMatcher(ours_g)
        a, b = torch.zeros(1, words, dtype=torch.int32), torch.zeros(1, words, dtype=torch.int32)
        for _ in range(40):
            ref.fill_next_token_bitmask(a)
            ours.fill_next_token_bitmask(b)
            assert np.array_equal(_bits(a, vocab), _bits(b, vocab))
            allowed = _allowed(a, vocab)
            assert len(allowed)
            tok = int(rng.choice(allowed))
            assert ref.accept_token(tok) and ours.accept_token(tok)
            if ref.is_terminated():
                assert ours.is_terminated()
                break


def test_unbounded_and_huge_bounds_keep_xgrammar_form():
    free = _no_control_chars(str(xgr.Grammar.from_json_schema(json.dumps({"type": "string", "minLength": 2}))))
    huge = _no_control_chars(str(xgr.Grammar.from_json_schema(json.dumps({"type": "string", "maxLength": 257}))))
    assert expand_bounded_strings(free) == free and expand_bounded_strings(huge) == huge
    assert "_len_0_4_" in json_schema_ebnf(str(xgr.Grammar.from_json_schema(json.dumps({"type": "string",
                                                                                      "maxLength": 4}))))


@pytest.mark.parametrize("threads", [1, 4])
def test_parallel_fill_equals_serial_fill(threads):
    vocab = _vocab()
    gc = GrammarCompiler(vocab, len(vocab), [len(vocab) - 1], timeout_s=60.0, threads=1, fill_threads=threads)
    grammars = [gc.check(("json_schema", json.dumps(BOUNDED[n]))) for n in ("min_max", "array", "person")]
    rng = random.Random(3)
    matchers = [gc.matcher(grammars[i % 3]) for i in range(9)]
    words = (len(vocab) + 31) // 32
    for _ in range(15):
        live = [m for m in matchers if not m.is_terminated()]
        if not live:
            break
        batch = torch.zeros(len(live), words, dtype=torch.int32)
        gc.fill_bitmask(live, batch)
        for i, m in enumerate(live):
            one = torch.zeros(1, words, dtype=torch.int32)
            m.fill_next_token_bitmask(one)
            assert torch.equal(batch[i], one[0])
            assert m.accept_token(int(rng.choice(_allowed(one, len(vocab)))))
