"""TokenReach: the most characters of a text one token can stand for, so a gateway can refuse a text that
is certainly past the context (N characters make at least N / reach tokens) without tokenizing it.

Only a tokenizer where (nearly) every input character ends up inside some token has one: a fast BPE
tokenizer that is byte-level or falls back to bytes. Every step that can take characters away either
gives up the bound (of_tokenizer: None, and texts are tokenized to be measured) or is accounted for:
- A byte missing from the vocabulary is dropped (or becomes an unknown token, which fuse_unk lets swallow a
  run): an ASCII character of such a byte counts for nothing (`vanishing`; SmolLM2 lacks six control
  characters). Byte-level: a missing UTF-8 continuation byte means no bound (a multi-byte character may
  leave nothing). Byte fallback turns a character with any missing byte into one unknown token, so a
  missing non-ASCII byte is fine only with an unknown token and no fuse_unk (a run of 🙂 must not become
  one token, nor none).
- An added token with lstrip / rstrip swallows a whole run of whitespace beside it (RoBERTa's <mask>,
  Phi-3's <|end|>): whitespace counts as vanishing; still a bound for ordinary text (a sixth of it is
  whitespace), none for whitespace itself, which is what such a token may eat.
- A normalizer may shrink the text: NFC / NFKC join up to 4 code points into one (a base letter and 3
  combining marks: U+1F87), a string Replace turns len(pattern) characters into len(content); the reach
  is the longest token times each step's most shrinking. A regex Replace, a replacement by nothing, Strip,
  StripAccents, BertNormalizer, Nmt and Precompiled (SentencePiece's charsmap: arbitrary many-to-fewer maps
  and deletions) have no sure ratio: no bound."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from typing import Any

import msgspec

from runtime.errors import InvalidRequestError

# Pre-tokenizers and normalizers that keep every character (their JSON "type"); Replace is checked further.
_KEEPING_PRE = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts",
                          "Sequence"})
_KEEPING_NORM = frozenset({"NFD", "NFKD", "NFC", "NFKC", "Lowercase", "Prepend", "Replace", "Sequence"})
# Normalizers that map characters by Unicode tables: none makes a control character out of another one
# (checked over Unicode 14), so they may only turn other characters into a vanishing control character.
_UNICODE_NORM = frozenset({"NFD", "NFKD", "NFC", "NFKC", "Lowercase"})
_COMPOSING = frozenset({"NFC", "NFKC"})
_MAX_COMPOSED = 4  # code points NFC may join into one
_CONTINUATION = range(0x80, 0xC0)  # UTF-8's continuation bytes: every multi-byte character holds one
_UTF8_NON_ASCII = frozenset((*_CONTINUATION, *range(0xC2, 0xF5)))  # 0xC0, 0xC1, 0xF5.. never occur
# Rust's char::is_whitespace (Unicode White_Space): what an lstrip / rstrip added token swallows.
_WHITESPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
               "\u200a\u2028\u2029\u202f\u205f\u3000")


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
            added = list(backend.get_added_tokens_decoder().values())
        except (AttributeError, TypeError, ValueError):  # parts that do not serialize: no bound, never a wrong one
            return None
        if any(p.get("type") not in _KEEPING_PRE or p.get("behavior") == "Removed" for p in pre):
            return None
        shrink = _shrink(norm)
        vocab = hf.get_vocab()
        missing = _missing_bytes(backend, pre, vocab)
        if shrink is None or missing is None:
            return None
        vanishing = "".join(chr(b) for b in sorted(missing) if b < 0x80)
        if not _keeps_others(norm, pre, vanishing):
            return None
        if any(t.lstrip or t.rstrip for t in added):
            if norm and any(t.normalized and (t.lstrip or t.rstrip) for t in added):
                return None  # it strips the normalized text, whose whitespace a normalizer may have made
            vanishing += "".join(c for c in _WHITESPACE if c not in vanishing)
        # The stored form (byte-level's one character per byte, SentencePiece's "▁" per space, "<0x41>" for a
        # fallback byte, "<unk>" for one character) is never shorter than the text the token covers; added
        # tokens cover their content.
        longest = max((len(t) for t in vocab), default=1)
        return cls(math.ceil(longest * shrink), vanishing)


def _shrink(norm: list[dict[str, Any]]) -> Fraction | None:
    """The most characters the normalizers may make out of one they put out (a text of N characters is at
    least N / this after them), or None where they may delete characters without a bound."""
    shrink = Fraction(1)
    for n in norm:
        kind = n.get("type")
        if kind not in _KEEPING_NORM:
            return None
        if kind in _COMPOSING:
            shrink *= _MAX_COMPOSED
        elif kind == "Replace":
            pattern, content = (n.get("pattern") or {}).get("String"), n.get("content")
            if not isinstance(pattern, str) or not pattern or not content:
                return None  # a regex, or a replacement by nothing, may take any run away
            shrink *= max(Fraction(1), Fraction(len(pattern), len(content)))
    return shrink


def _keeps_others(norm: list[dict[str, Any]], pre: list[dict[str, Any]], vanishing: str) -> bool:
    """Whether only the vanishing characters themselves may vanish: no normalizer or pre-tokenizer turns
    another character into one (a Replace's content, a Metaspace replacement, a Unicode map to a letter)."""
    if not vanishing:
        return True
    if any(n.get("type") == "Replace" and any(c in vanishing for c in n.get("content") or "") for n in norm):
        return False
    if any(p.get("type") == "Metaspace" and p.get("replacement") in set(vanishing) for p in pre):
        return False
    unicode_maps = any(n.get("type") in _UNICODE_NORM for n in norm)
    return not unicode_maps or all(ord(c) < 0x20 or ord(c) == 0x7F for c in vanishing)


def _missing_bytes(backend: Any, pre: list[dict[str, Any]], vocab: dict[str, int]) -> set[int] | None:
    """The bytes with no token of their own: byte-level's 256-symbol alphabet, or byte fallback's <0xNN>;
    None for a tokenizer that is neither (an unknown character may swallow any run), or where a missing
    byte may take a whole non-ASCII character (or a run of them) away."""
    model = backend.model
    if any(p.get("type") == "ByteLevel" for p in pre):
        # A symbol is looked up with the subword prefix / word suffix where it is not first / is last.
        prefix, suffix = model.continuing_subword_prefix or "", model.end_of_word_suffix or ""
        forms = {("", ""), (prefix, ""), ("", suffix), (prefix, suffix)}
        missing = {b for b, c in enumerate(_byte_symbols()) if any(p + c + s not in vocab for p, s in forms)}
        return None if any(b in missing for b in _CONTINUATION) else missing
    if getattr(model, "byte_fallback", False):
        missing = {b for b in range(256) if f"<0x{b:02X}>" not in vocab}
        # A character with any missing byte is one unknown token, none without one, a run of them one with
        # fuse_unk.
        one_each = model.unk_token in vocab and not model.fuse_unk
        return None if not one_each and not missing.isdisjoint(_UTF8_NON_ASCII) else missing
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
