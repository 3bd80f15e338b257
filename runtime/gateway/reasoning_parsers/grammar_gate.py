"""grammar_gate: how a grammar-constrained chat request (response_format, regex, ebnf, guided_*, tool_choice
"required" / named) meets --reasoning-parser, as vLLM and SGLang do it: the model reasons freely and the
grammar constrains only after the think-end tag (SamplingParams.grammar_after_token), unless the prompt
already closed the reasoning (Qwen3's enable_thinking false renders an empty <think></think>), where the
grammar applies from the first token and the whole output is the answer."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.gateway.reasoning_parsers.base import THINK_CLOSE, THINK_OPEN, ReasoningParser


@dataclass(frozen=True, slots=True)
class GrammarGate:
    after_token: int | None  # SamplingParams.grammar_after_token: None when the prompt closed the reasoning
    reasoning_done: bool  # the prompt closed the reasoning: the output is all content


class AnswerOnlyParser(ReasoningParser):
    """The prompt ended the reasoning: every output token is the answer. (DeepSeek-R1's parser would read an
    output without </think> as reasoning, and the grammar's JSON would land in reasoning_content.)"""

    def split(self, text: str, final: bool) -> tuple[str, str]:
        return "", text


def grammar_gate(tokenizer: Any, prompt_ids: Sequence[int]) -> GrammarGate | None:
    """None when the tokenizer does not spell </think> as one token: the scheduler's grammar can wait for a
    single token only (a tag split into pieces may also be sampled in other splits), so the caller keeps
    the grammar from the first token."""
    start, end = _tag_ids(tokenizer)
    if end is None:
        return None
    if _last(prompt_ids, end) > _last(prompt_ids, start):  # vLLM's is_reasoning_end over the prompt
        return GrammarGate(None, True)
    return GrammarGate(end, False)


@functools.lru_cache(maxsize=8)
def _tag_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    """(<think>'s id, </think>'s id), each None unless the tokenizer encodes it as exactly one token."""
    if getattr(tokenizer, "is_null", False):
        return None, None

    def one(tag: str) -> int | None:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    return one(THINK_OPEN), one(THINK_CLOSE)


def _last(ids: Sequence[int], token: int | None) -> int:
    """Index of token's last occurrence in ids, -1 if absent (a reversed scan in C: prompts can be long)."""
    if token is None:
        return -1
    rev = list(reversed(ids))
    try:
        return len(rev) - 1 - rev.index(token)
    except ValueError:
        return -1
