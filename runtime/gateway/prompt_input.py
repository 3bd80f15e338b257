"""PromptInput: a prompt as OpenAI's /v1/completions (`prompt`) and SGLang's /generate (`text` or
`input_ids`) take it — a string, a list of strings, a list of token ids, or a list of token-id lists —
as token ids per prompt. Token ids are checked against the vocabulary later, by EngineClient.validate.
vLLM's truncate_prompt_tokens keeps each prompt's last k tokens (truncate_prompt)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from runtime.gateway.errors import bad_request


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not token 1


class PromptInput(msgspec.Struct, frozen=True):
    ids: list[list[int]]  # token ids per prompt
    texts: list[str | None]  # each prompt's text as sent, None for token ids
    batch: bool  # sent as a list of prompts (one answer per prompt) rather than one

    @classmethod
    def parse(cls, value: object, encode: Callable[[str], list[int]], param: str = "prompt",
              allow_text: bool = True) -> PromptInput:
        """value as the client sent it; param names the field in errors; allow_text False takes token ids only."""
        if allow_text and isinstance(value, str):
            return cls([encode(value)], [value], batch=False)
        if isinstance(value, list) and value:
            if allow_text and all(isinstance(p, str) for p in value):
                return cls([encode(p) for p in value], list(value), batch=True)
            if all(_is_id(t) for t in value):
                return cls([list(value)], [None], batch=False)
            if all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in value):
                return cls([list(p) for p in value], [None] * len(value), batch=True)
        kinds = "a list of token ids or a list of non-empty token-id lists"
        if allow_text:
            kinds = "a string, a list of strings, " + kinds
        raise bad_request(f"{param} must be {kinds} (not a mix), and not empty", param=param)

    def truncated(self, keep: int | None, context_len: int) -> PromptInput:
        """Each prompt cut to its last `keep` tokens (truncate_prompt_tokens); a cut prompt's text is gone."""
        ids = [truncate_prompt(p, keep, context_len) for p in self.ids]
        texts = [t if len(new) == len(old) else None for t, new, old in zip(self.texts, ids, self.ids)]
        return PromptInput(ids, texts, self.batch)


def truncate_prompt(ids: list[int], keep: int | None, context_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens of the prompt (-1: as many as the context
    holds); None keeps it whole. A value outside [1, context length] other than -1 is a 400."""
    if keep is None:
        return ids
    if keep == -1:
        keep = context_len
    if not 1 <= keep <= context_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, {context_len}] (the context length), "
                          f"got {keep}", param="truncate_prompt_tokens")
    return ids[-keep:] if len(ids) > keep else ids
