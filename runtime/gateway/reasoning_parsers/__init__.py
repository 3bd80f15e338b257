"""Reasoning parsers: one model family per module, registered by name (--reasoning-parser)."""

from runtime.gateway.reasoning_parsers import deepseek_r1, mistral, qwen3  # noqa: F401  (registration)
from runtime.gateway.reasoning_parsers.base import (
    ReasoningParser,
    create_reasoning_parser,
    reasoning_parser_names,
    reasoning_tags,
)

__all__ = ["ReasoningParser", "create_reasoning_parser", "reasoning_parser_names", "reasoning_tags"]
