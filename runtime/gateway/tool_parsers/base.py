"""ToolParser: a model's own tool-call format (tool_choice "auto") read out of its text — the content
around the calls and each call's name and raw arguments. parse() takes the whole text so far and is
monotone: what it returns as content, or as a call's arguments (up to CallSpan.stable) for a prefix stays a
prefix of what it returns once more text came (a tail that may still become a call marker is held back until it is decided), so a
stream can send differences and the pieces concatenate to the finished answer. One class per format,
registered by name for --tool-call-parser."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.gateway.tool_parsers.json_scan import CallSpan, ValueScans


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
    # Whether a call's name and arguments stream before the call settles: its name once whole, then its
    # arguments as they grow (CallSpan.stable: only what no later text changes), as vLLM and SGLang stream
    # them. Where a grammar Shoal built shapes the output (tool_choice "required" or named) the call always
    # settles. In a model's own format it may not (the output ends inside it, or its JSON breaks): the
    # finished answer then has its raw text as content, and a stream, which cannot take back what it sent,
    # keeps the call as far as it went and sends that raw text as content too. A format whose arguments
    # are not the model's text and cannot be built piecewise (pythonic) sends each call whole once settled.
    streams_partial_calls = False

    def __init__(self, tools: Sequence[dict[str, Any]] | None = None):
        """tools: the request's tools (OpenAI tool objects), for formats whose calls need their schemas
        (qwen3_coder types its parameter text by them) or names (a Mistral call whose markers the
        detokenizer dropped)."""
        self.tools: tuple[dict[str, Any], ...] = tuple(tools or ())
        # The JSON values this output's text holds, scanned so far: parse() reads the whole text on every
        # update of a stream, and a format that scans JSON (scan_call) goes on from where the last one stopped.
        self.scans = ValueScans()

    def tool_names(self) -> list[str]:
        return [n for t in self.tools if isinstance(n := (t.get("function") or {}).get("name"), str)]

    def tool_properties(self, name: str) -> dict[str, Any]:
        """The JSON schemas of function `name`'s parameters ({} for an unknown function or no schema)."""
        for t in self.tools:
            fn = t.get("function") or {}
            if fn.get("name") == name:
                props = (fn.get("parameters") or {}).get("properties")
                return props if isinstance(props, dict) else {}
        return {}

    def new_call_id(self) -> str:
        """The id a call this parser read goes out with (OpenAI's shape; a format may need its own)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The content and calls in text (final: no more text comes, so nothing is held back)."""


_REGISTRY: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def wrap(cls: type[ToolParser]) -> type[ToolParser]:
        _REGISTRY[name] = cls
        return cls
    return wrap


def create_tool_parser(name: str, tools: Sequence[dict[str, Any]] | None = None) -> ToolParser:
    """A fresh parser of format `name` for one output; tools: the request's tools."""
    import runtime.gateway.tool_parsers  # noqa: F401  (registers every format)

    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    return cls(tools)


def tool_parser_names() -> list[str]:
    import runtime.gateway.tool_parsers  # noqa: F401

    return sorted(_REGISTRY)
