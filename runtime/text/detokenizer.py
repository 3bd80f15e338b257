"""IncrementalDetokenizer: turns a growing list of token ids into text deltas that never split a UTF-8
character or lose a leading space, and that stop before (and never show) a stop string — or, with
include_stop (vLLM's include_stop_str_in_output), right after it. Either way nothing past it shows.

With min_new_tokens = m, a stop string counts only if it ends in the text of token m or later (as in
vLLM, and as the scheduler's own check): one already complete in the first m - 1 tokens is plain text."""

from __future__ import annotations

from collections.abc import Callable

from runtime.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 min_new_tokens: int = 0, include_stop: bool = False):
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.min_new_tokens = min_new_tokens
        # Text length of the first min_new_tokens - 1 tokens: a stop string must end beyond it.
        self._stop_floor: int | None = 0 if min_new_tokens <= 1 else None
        self.ids: list[int] = []
        self.text = ""  # every complete character decoded so far
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False
        self._prefix_offset = 0
        self._read_offset = 0
        self._step = tokenizer.decode_stream(skip_special_tokens)  # fast path when exact

    def add(self, new_ids: list[int], finished: bool = False) -> str:
        """Adds tokens; returns the text that is now safe to show."""
        if self.stopped:
            return ""
        if self._stop_floor is None and len(self.ids) + len(new_ids) >= self.min_new_tokens - 1:
            cut = self.min_new_tokens - 1 - len(self.ids)
            self.ids.extend(new_ids[:cut])
            self._advance()
            self._stop_floor, new_ids = len(self.text), new_ids[cut:]
        self.ids.extend(new_ids)
        self._advance()
        end = len(self.text)
        if self._stop_floor is not None and len(self.ids) >= self.min_new_tokens:
            first: tuple[int, int] | None = None  # (start, end) of the earliest stop string in the text
            for s in self.stop:
                at = self.text.find(s, max(0, self._stop_floor - len(s) + 1))
                if at != -1 and (first is None or at < first[0]):
                    first = (at, at + len(s))
            if first is not None:
                self.stopped, end = True, min(end, first[1] if self.include_stop else first[0])
        if self.stopped:
            self.text = self.text[:end]
        elif not finished:
            end -= self._held_back()
        if finished and not self.stopped:
            self._flush()
            end = len(self.text)
        delta = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    def _advance(self) -> None:
        if self._step is not None:
            for i in range(self._read_offset, len(self.ids)):
                chunk = self._step(self.ids[i])
                if chunk:
                    self.text += chunk
                    self._prefix_offset = i + 1  # every id before this one is in the text
            self._read_offset = len(self.ids)
            return
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full = dec(self.ids[self._prefix_offset:], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)

    def _flush(self) -> None:
        if self._step is not None:
            # Ids whose bytes never completed a character: show them as decode() would (U+FFFD).
            if self._prefix_offset < len(self.ids):
                full = self.tokenizer.decode(self.ids, self.skip_special_tokens)
                if full.startswith(self.text):
                    self.text = full
            return
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full = self.tokenizer.decode(self.ids[self._prefix_offset:], self.skip_special_tokens)
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
        self._prefix_offset = self._read_offset = len(self.ids)

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that could still grow into a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best


def stop_check_tail(decode: Callable[[list[int], bool], str], ids: list[int], max_stop_len: int,
                    skip_special_tokens: bool = True) -> tuple[str, int]:
    """The scheduler's stop-string check after each token: the text of the last few ids, and where the
    newest token's text starts in it, counted as the detokenizer counts text: a token whose bytes end
    mid-character shows nothing until the character completes, so its text starts with the newest.
    Special tokens are skipped or kept as the request's IncrementalDetokenizer does, so a stop string
    made of their text ends the request here exactly when the client's text reaches it."""
    window = ids[-(max_stop_len + 4):]
    text, k = decode(window, skip_special_tokens), len(window) - 1
    before = decode(window[:k], skip_special_tokens)
    while k > 0 and before.endswith("\ufffd"):
        k -= 1
        before = decode(window[:k], skip_special_tokens)
    return text, min(len(before), len(text))
