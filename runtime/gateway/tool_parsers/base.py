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

    def unfinished(self, raw: str, calls: int, final: bool) -> ParsedOutput:
        """The text ends inside a call region (raw: its text from the marker on, holding the last `calls`
        calls). While text may still come the region is held back (its calls unsettled); once none will,
        the model never finished it: its raw text is content and its calls are dropped, as vLLM answers."""
        if final:
            self.content += raw
            del self.calls[len(self.calls) - calls:]
        else:
            for c in self.calls[len(self.calls) - calls:]:
                c.complete = False
        return self


class ToolParser(ABC):
    # Whether a call's name and arguments may stream before the call settles. Only where a grammar Shoal
    # built shapes the output (tool_choice "required" or named): a model's own format may end with a call
    # it never finished, which is then content, so nothing of a call goes out before it is complete.
    streams_partial_calls = False

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
