"""TokenReach: the most characters of a text one token can stand for, so a gateway can refuse a text that
is certainly past the context (N characters make at least N / reach tokens) without tokenizing it.

Only a tokenizer where (nearly) every input character ends up inside some token has one: a fast BPE
tokenizer that is byte-level or falls back to bytes, with no pre-tokenizer or normalizer that drops
characters (BERT's whitespace split, Strip, a regex Replace). A byte missing from its vocabulary is dropped
(or becomes an unknown token, which may swallow a run): an ASCII character of such a byte counts for
nothing (`vanishing`; SmolLM2 lacks six control characters), and a missing UTF-8 continuation byte means no
bound at all. A composing normalizer (NFC / NFKC) may join up to 4 code points into one (a base letter and 3
combining marks: U+1F87), so its reach is 4 times the longest token. Every other tokenizer has no reach
(of_tokenizer: None), and its texts are tokenized to be measured."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from runtime.errors import InvalidRequestError

# Pre-tokenizers and normalizers that keep every character (their JSON "type").
_KEEPING_PRE = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts",
                          "Sequence"})
_KEEPING_NORM = frozenset({"NFD", "NFKD", "NFC", "NFKC", "Lowercase", "Prepend", "Replace", "Sequence"})
_COMPOSING = frozenset({"NFC", "NFKC"})
_MAX_COMPOSED = 4  # code points NFC may join into one
_CONTINUATION = range(0x80, 0xC0)  # UTF-8's continuation bytes: every multi-byte character holds one


class TokenReach(msgspec.Struct, frozen=True):
    chars: int  # the most characters one token covers
    vanishing: str = ""  # characters that may make no token at all

    def certainly_past(self, text: str, tokens: int) -> bool:
        """Whether text makes more than `tokens` tokens for sure (False: it may not; tokenize to know)."""
        limit = tokens * self.chars
        if len(text) <= limit:
            return False
        return len(text) - sum(text.count(c) for c in self.vanishing) > limit

    def check(self, text: str, context_len: int, param: str) -> None:
        """InvalidRequestError context_length_exceeded naming param for a text certainly past context_len."""
        if self.certainly_past(text, context_len):
            raise InvalidRequestError(f"This model's maximum context length is {context_len} tokens, but {param} "
                                      f"has {len(text)} characters: more than {context_len} tokens for sure (a "
                                      f"token of this tokenizer covers at most {self.chars} characters). "
                                      "Shorten it.", param=param, code="context_length_exceeded")

    @classmethod
    def of_tokenizer(cls, hf: Any) -> TokenReach | None:
        """hf: a transformers tokenizer. Its reach, or None where no bound holds."""
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None or type(backend.model).__name__ != "BPE":  # a slow tokenizer is not inspectable
            return None
        try:
            pre, norm = _parts(backend.pre_tokenizer), _parts(backend.normalizer)
        except (AttributeError, TypeError, ValueError):  # parts that do not serialize: no bound, never a wrong one
            return None
        if any(p.get("type") not in _KEEPING_PRE or p.get("behavior") == "Removed" for p in pre):
            return None
        for n in norm:
            if n.get("type") not in _KEEPING_NORM:
                return None
            if n.get("type") == "Replace" and ("String" not in (n.get("pattern") or {}) or not n.get("content")):
                return None  # a regex, or a replacement by nothing, may take characters away
        vocab = hf.get_vocab()
        missing = _missing_bytes(backend, pre, vocab)
        if missing is None or any(b in missing for b in _CONTINUATION):
            return None
        # The stored form (byte-level's one character per byte, SentencePiece's "▁" per space, "<0x41>" for a
        # fallback byte) is never shorter than the text the token covers; added tokens cover their content.
        longest = max((len(t) for t in vocab), default=1)
        composing = any(n.get("type") in _COMPOSING for n in norm)
        return cls(longest * (_MAX_COMPOSED if composing else 1), "".join(chr(b) for b in sorted(missing) if b < 0x80))


def _missing_bytes(backend: Any, pre: list[dict[str, Any]], vocab: dict[str, int]) -> set[int] | None:
    """The bytes with no token of their own: byte-level's 256-symbol alphabet, or byte fallback's <0xNN>;
    None for a tokenizer that is neither (an unknown character may swallow any run)."""
    if any(p.get("type") == "ByteLevel" for p in pre):
        return {b for b, c in enumerate(_byte_symbols()) if c not in vocab}
    if getattr(backend.model, "byte_fallback", False):
        return {b for b in range(256) if f"<0x{b:02X}>" not in vocab}
    return None


def _byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode: byte b's symbol in a byte-level vocabulary, at index b."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    symbol = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
    return [symbol[b] for b in range(256)]


def _parts(component: Any) -> list[dict[str, Any]]:
    """A pre-tokenizer's or normalizer's JSON, a Sequence's members flattened in after it."""
    return [] if component is None else _flatten(json.loads(component.__getstate__()))


def _flatten(state: dict[str, Any]) -> list[dict[str, Any]]:
    out = [state]
    for key in ("pretokenizers", "normalizers"):
        for member in state.get(key) or ():
            out.extend(_flatten(member))
    return out
