"""DeepSeekR1ReasoningParser: DeepSeek-R1's chat template opens <think> in the prompt, so the output
starts inside the reasoning (a <think> the model repeats is dropped); until </think> everything is
reasoning, and an output that never closes it is all reasoning."""

from __future__ import annotations

from runtime.gateway.reasoning_parsers.base import THINK_OPEN, ReasoningParser, register_reasoning_parser


@register_reasoning_parser("deepseek-r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    def split(self, text: str, final: bool) -> tuple[str, str]:
        stripped = text.lstrip()
        if stripped.startswith(THINK_OPEN):
            return self._inside(stripped[len(THINK_OPEN):], final)
        if not final and THINK_OPEN.startswith(stripped):
            return "", ""
        return self._inside(text, final)
