"""grammar_gate: how a grammar-constrained chat request (response_format, regex, ebnf, guided_*, tool_choice
"required" / named) meets --reasoning-parser, as vLLM and SGLang do it: the model reasons freely and the
grammar constrains only after the think-end tag (SamplingParams.grammar_after_token), unless the prompt
already closed the reasoning (Qwen3's enable_thinking false renders an empty <think></think>), where the
grammar applies from the first token and the whole output is the answer."""

from __future__ import annotations

import functools
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


def grammar_gate(tokenizer: Any, opening: str) -> GrammarGate | None:
    """opening: the text the model's turn starts from (turn_opening). None when the tokenizer does not spell
    </think> as one token: the scheduler's grammar can wait for a single token only (a tag split into pieces
    may also be sampled in other splits), so the caller keeps the grammar from the first token."""
    _, end = _tag_ids(tokenizer)
    if end is None:
        return None
    if opening.rfind(THINK_CLOSE) > opening.rfind(THINK_OPEN):  # vLLM's is_reasoning_end, on the turn's start
        return GrammarGate(None, True)
    return GrammarGate(end, False)


def turn_opening(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 add_generation_prompt: bool, continue_final_message: bool,
                 template_kwargs: dict[str, Any] | None) -> str:
    """What the prompt puts at the start of the model's turn: the template's generation prompt (Qwen3's
    empty <think></think> under enable_thinking false, R1's open <think>), or the final assistant message
    being continued. Only this part says whether the reasoning is closed: a user who writes "</think>" in a
    question has not closed the model's reasoning."""
    if continue_final_message:
        content = messages[-1].get("content") if messages else None
        if isinstance(content, list):  # text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return content if isinstance(content, str) else ""
    if not add_generation_prompt:
        return ""
    full = tokenizer.render_chat(messages, True, tools, False, template_kwargs)
    base = tokenizer.render_chat(messages, False, tools, False, template_kwargs)
    return full[len(base):] if full.startswith(base) else full  # a template that rewrites earlier turns


@functools.lru_cache(maxsize=8)
def _tag_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    """(<think>'s id, </think>'s id), each None unless the tokenizer encodes it as exactly one token."""
    if getattr(tokenizer, "is_null", False):
        return None, None

    def one(tag: str) -> int | None:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    return one(THINK_OPEN), one(THINK_CLOSE)
