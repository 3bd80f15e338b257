"""TokenSpelling: a token id's text and raw UTF-8 bytes, as OpenAI's logprobs report them (`token`,
`bytes`), read from the same vocabulary piece so the two agree.

A token can hold part of a character (an emoji is often 2-4 tokens). Its text is then "\ufffd", and the
bytes of that text (239, 191, 189) are not the token's: a client joining each token's `bytes` to rebuild
the output would get garbage. The real bytes come from the vocabulary piece: byte-level BPE vocabularies
(GPT-2, Llama 3, Qwen, SmolLM) spell each byte as one printable character (GPT-2's bytes_to_unicode);
SentencePiece vocabularies with byte fallback (Llama 2, Mistral) spell a raw byte as "<0xNN>" and a space
as "\u2581" (decode() of such a token alone drops its leading space; the piece keeps it, as OpenAI's
tokens do). Added tokens (special or not) are spelled as their content; anything else as decode() says."""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "\u2581"


def _byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable Latin-1 stands for itself, the other bytes for
    the code points from 256 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _decoder_types(hf: Any) -> set[str]:
    backend = getattr(hf, "backend_tokenizer", None) or getattr(hf, "_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return set()
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {p.get("type", "") for p in parts if isinstance(p, dict)}


class TokenSpelling:
    def __init__(self, hf: Any):
        self.hf = hf
        kinds = _decoder_types(hf)
        self.byte_level = _byte_level_decoder() if "ByteLevel" in kinds else None
        self.byte_fallback = "ByteFallback" in kinds
        # Added tokens (specials, add_tokens()) by their content: decode() runs a byte-level decoder over
        # the content too, and turns "café" into "caf\ufffd".
        self.added = {i: getattr(t, "content", str(t)) for i, t in (getattr(hf, "added_tokens_decoder", None)
                                                                     or {}).items()}

    def text(self, token_id: int) -> str:
        if token_id in self.added:
            return self.added[token_id]
        piece = self._piece(token_id)
        if piece is not None and self.byte_fallback and not _BYTE_PIECE.fullmatch(piece):
            return piece.replace(_SPACE, " ")
        return self.hf.decode([token_id], skip_special_tokens=False)

    def bytes(self, token_id: int) -> bytes:
        piece = self._piece(token_id)
        if piece is not None:
            if self.byte_level is not None and all(c in self.byte_level for c in piece):
                return bytes(self.byte_level[c] for c in piece)
            if self.byte_fallback:
                m = _BYTE_PIECE.fullmatch(piece)
                return bytes([int(m[1], 16)]) if m else piece.replace(_SPACE, " ").encode("utf-8")
        return self.text(token_id).encode("utf-8")

    def _piece(self, token_id: int) -> str | None:
        if token_id in self.added:
            return None
        piece = self.hf.convert_ids_to_tokens(token_id)
        return piece if isinstance(piece, str) else None
