"""ToolParser: a model's own tool-call format (tool_choice "auto") read out of its text — the content
around the calls and each call's name and raw arguments. parse() takes the whole text so far and is
monotone: what it returns as content or arguments for a prefix stays a prefix of what it returns once
more text came (a tail that may still become a call marker is held back until it is decided), so a
stream can send differences and the pieces concatenate to the finished answer. One class per format,
registered by name for --tool-call-parser."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.gateway.tool_parsers.json_scan import CallSpan


@dataclass(slots=True)
class ParsedOutput:
    content: str
    calls: list[CallSpan] = field(default_factory=list)


class ToolParser(ABC):
    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The content and calls in text (final: no more text comes, so nothing is held back)."""


_REGISTRY: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def wrap(cls: type[ToolParser]) -> type[ToolParser]:
        _REGISTRY[name] = cls
        return cls
    return wrap


def create_tool_parser(name: str) -> ToolParser:
    import runtime.gateway.tool_parsers  # noqa: F401  (registers every format)

    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def tool_parser_names() -> list[str]:
    import runtime.gateway.tool_parsers  # noqa: F401

    return sorted(_REGISTRY)
