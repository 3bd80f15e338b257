"""tokenize_bad_words: a request's bad_words strings as the token id sequences the sampler bans (vLLM's
rule), done where the tokenizer lives (the Engine, the gateway): the scheduler sees only bad_words_ids."""

from __future__ import annotations

import msgspec

from runtime.errors import InvalidRequestError
from runtime.sampling.params import SamplingParams
from runtime.text.tokenizer import NullTokenizer, Tokenizer


def tokenize_bad_words(params: SamplingParams, tokenizer: Tokenizer | NullTokenizer) -> SamplingParams:
    """params with its bad_words appended to bad_words_ids and cleared; InvalidRequestError naming
    bad_words for a word that gives no tokens, too many sequences, or a server without a tokenizer.

    As vLLM: each word (its leading whitespace stripped) is tokenized without special tokens as is, and
    again after a space, so it is banned at the start of the text and after a space alike; the spaced form
    is kept only where it is a different word token of the same length (a tokenizer that merges the space
    into the word; where the space stays a token of its own, the plain form already bans the word)."""
    if not params.bad_words:
        return params
    if tokenizer.is_null:
        raise InvalidRequestError("bad_words needs a tokenizer, and this model folder has none: give "
                                  "bad_words_ids (token id sequences) instead", param="bad_words")
    seqs = [list(w) for w in params.bad_words_ids]
    for word in dict.fromkeys(params.bad_words):  # duplicates dropped, as vLLM
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise InvalidRequestError(f"bad word {word!r} gives no tokens", param="bad_words")
        seqs.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(spaced)
    out = msgspec.structs.replace(params, bad_words=[], bad_words_ids=seqs)
    try:
        out.validate()
    except InvalidRequestError as e:  # the limits on token sequences, reached through the words given
        if e.param != "bad_words_ids":
            raise
        raise InvalidRequestError(f"bad_words, tokenized: {e.message}", param="bad_words") from None
    return out
