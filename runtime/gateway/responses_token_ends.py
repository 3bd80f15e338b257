"""TokenTextEnds: where each output token's text ends, kept as a Responses stream's tokens arrive, so
the responder finds the tokens behind a stretch of text (the answer after </think>, the message before a
function call) by a bisect. Searching by full decodes of each prefix instead cost O(length) per probe on
every delta: quadratic in the answer's length.

The text is the one the choice's own IncrementalDetokenizer makes (same tokenizer, same
skip_special_tokens, no stop strings): a character split over several tokens ends at the token that
completes it, and the offsets are the ones ChatOutput's parse of the choice's text counts in."""

from __future__ import annotations

import bisect

from runtime.text.detokenizer import IncrementalDetokenizer
from runtime.text.tokenizer import Tokenizer


class TokenTextEnds:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.ends = [0]  # ends[i]: the length of the text of the first i tokens

    def text(self, ids: list[int]) -> str:
        """The text of ids (the choice's growing list: only the tokens not yet seen are decoded)."""
        for token in ids[len(self.ends) - 1:]:
            self._detok.add([token])
            self.ends.append(len(self._detok.text))
        return self._detok.text

    def first_reaching(self, ids: list[int], length: int, lo: int) -> int:
        """The fewest tokens, at least lo, whose text is at least `length` characters long (all of them
        when none is)."""
        self.text(ids)
        return min(len(ids), max(lo, bisect.bisect_left(self.ends, length)))
