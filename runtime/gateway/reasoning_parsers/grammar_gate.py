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


def grammar_gate(tokenizer: Any, opening: str,
                 tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)) -> GrammarGate | None:
    """opening: the text the model's turn starts from (turn_opening); tags: the reasoning parser's opening and
    closing tags (ReasoningParser.tags: Magistral's are [THINK] / [/THINK]). None when the tokenizer does not
    spell the closing tag as one token: the scheduler's grammar can wait for a single token only (a tag split
    into pieces may also be sampled in other splits), so the caller keeps the grammar from the first token."""
    open_tag, close_tag = tags
    end = _one_token(tokenizer, close_tag)
    if end is None:
        return None
    if opening.rfind(close_tag) > opening.rfind(open_tag):  # vLLM's is_reasoning_end, on the turn's start
        return GrammarGate(None, True)
    return GrammarGate(end, False)


def turn_opening(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 add_generation_prompt: bool, continue_final_message: bool,
                 template_kwargs: dict[str, Any] | None, rendered: str | None = None) -> str:
    """What the prompt puts at the start of the model's turn: the template's generation prompt (Qwen3's
    empty <think></think> under enable_thinking false, R1's open <think>), or the final assistant message
    being continued. Only this part says whether the reasoning is closed: a user who writes "</think>" in a
    question has not closed the model's reasoning. rendered: the chat already rendered with the generation
    prompt (the caller's own render: one render fewer)."""
    if continue_final_message:
        content = messages[-1].get("content") if messages else None
        if isinstance(content, list):  # text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return content if isinstance(content, str) else ""
    if not add_generation_prompt:
        return ""
    full = rendered if rendered is not None else tokenizer.render_chat(messages, True, tools, False, template_kwargs)
    base = tokenizer.render_chat(messages, False, tools, False, template_kwargs)
    return full[len(base):] if full.startswith(base) else full  # a template that rewrites earlier turns


@functools.lru_cache(maxsize=8)
def _one_token(tokenizer: Any, tag: str) -> int | None:
    """tag's id where the tokenizer encodes it as exactly one token, else None."""
    if getattr(tokenizer, "is_null", False):
        return None
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
