"""Qwen3ReasoningParser: Qwen3 writes <think>...</think> itself when it reasons; an output that does not
start with <think> (thinking off) is all content."""

from __future__ import annotations

from runtime.gateway.reasoning_parsers.base import THINK_OPEN, ReasoningParser, register_reasoning_parser


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    def split(self, text: str, final: bool) -> tuple[str, str]:
        stripped = text.lstrip()
        if stripped.startswith(THINK_OPEN):
            return self._inside(stripped[len(THINK_OPEN):], final)
        if not final and THINK_OPEN.startswith(stripped):
            return "", ""  # may still become <think>
        return "", text
