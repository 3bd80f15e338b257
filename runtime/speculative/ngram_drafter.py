"""NgramDrafter: prompt lookup. The longest recent suffix of the request's tokens (max..min window) that
occurred earlier in them proposes the tokens that followed that earlier occurrence — cheap and right
whenever the output copies from the prompt (edits, summaries, code) or repeats itself."""

from __future__ import annotations

from array import array

from runtime.config import ServerArgs
from runtime.speculative.drafter import Drafter


class NgramDrafter(Drafter):
    def __init__(self, args: ServerArgs):
        super().__init__(args)
        self.min_window = args.speculative_ngram_min_match_window_size
        self.max_window = args.speculative_ngram_max_match_window_size

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        n = len(token_ids)
        if max_drafts <= 0 or n < 2:
            return []
        # Byte search in C (bytes.rfind) instead of a Python loop: 4 bytes per token, matches kept aligned.
        buf = array("i", token_ids).tobytes()
        for w in range(min(self.max_window, n - 1), self.min_window - 1, -1):
            pattern = buf[(n - w) * 4:]
            end = (n - 1) * 4  # an earlier occurrence: it must end before the last token
            while True:
                pos = buf.rfind(pattern, 0, end)
                if pos < 0:
                    break
                if pos % 4 == 0:
                    start = pos // 4 + w
                    return token_ids[start:start + max_drafts]
                end = pos + len(pattern) - 1
        return []
