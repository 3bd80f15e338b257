"""ReasoningParser: splits a reasoning model's text into its reasoning (<think>...</think>) and the answer
after it (--reasoning-parser). split() takes the whole text so far and is monotone: both parts only
grow as text comes (a tail that may still become the closing tag is held back), so a stream sends
differences that concatenate to the finished answer's reasoning_content and content."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningParser(ABC):
    # The tags around the reasoning: grammar_gate waits for the closing one (a grammar constrains after it).
    tags: ClassVar[tuple[str, str]] = (THINK_OPEN, THINK_CLOSE)

    @abstractmethod
    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning so far, content so far)."""

    @staticmethod
    def _inside(text: str, final: bool) -> tuple[str, str]:
        """text starts inside the reasoning: up to </think> is reasoning, the rest (left-stripped) content."""
        end = text.find(THINK_CLOSE)
        if end < 0:
            if final:
                return text, ""
            hold = next((n for n in range(min(len(THINK_CLOSE) - 1, len(text)), 0, -1)
                         if text.endswith(THINK_CLOSE[:n])), 0)
            return text[:len(text) - hold], ""
        return text[:end], text[end + len(THINK_CLOSE):].lstrip()


_REGISTRY: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    def wrap(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        _REGISTRY[name] = cls
        return cls
    return wrap


def create_reasoning_parser(name: str) -> ReasoningParser:
    import runtime.gateway.reasoning_parsers  # noqa: F401  (registers every parser)

    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def reasoning_tags(name: str) -> tuple[str, str]:
    """The opening and closing reasoning tags of parser `name` (for grammar_gate)."""
    import runtime.gateway.reasoning_parsers  # noqa: F401

    try:
        return _REGISTRY[name].tags
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def reasoning_parser_names() -> list[str]:
    import runtime.gateway.reasoning_parsers  # noqa: F401

    return sorted(_REGISTRY)
