"""MistralReasoningParser: Magistral (Small / Medium 1.1 on) reasons between its control tokens [THINK] and
[/THINK], as vLLM's mistral parser reads them: the reasoning is what follows the first [THINK] up to
[/THINK] (all the rest when it never closes); the content is what precedes [THINK] plus what follows
[/THINK] (left-stripped, as Shoal's other parsers answer); an output without [THINK] is all content, a
stray [/THINK] dropped. The tags are special tokens, which skip_special_tokens removes: the output must
be decoded with them (skip_special_tokens false) for this parser to see any reasoning."""

from __future__ import annotations

from runtime.gateway.reasoning_parsers.base import ReasoningParser, register_reasoning_parser

_OPEN, _CLOSE = "[THINK]", "[/THINK]"


@register_reasoning_parser("mistral")
class MistralReasoningParser(ReasoningParser):
    tags = (_OPEN, _CLOSE)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        start = text.find(_OPEN)
        if start < 0:
            seen = text if final else text[:len(text) - _held(text, (_OPEN, _CLOSE))]
            return "", seen.replace(_CLOSE, "")
        before = text[:start].replace(_CLOSE, "")
        inner = text[start + len(_OPEN):]
        end = inner.find(_CLOSE)
        if end < 0:
            return (inner if final else inner[:len(inner) - _held(inner, (_CLOSE,))]), before
        return inner[:end], before + inner[end + len(_CLOSE):].lstrip()


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of text that may still grow into one of tags."""
    return max((n for tag in tags for n in range(min(len(tag) - 1, len(text)), 0, -1)
                if text.endswith(tag[:n])), default=0)
