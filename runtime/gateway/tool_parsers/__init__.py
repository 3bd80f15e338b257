"""Tool-call parsers: one format per module, registered by name (--tool-call-parser)."""

from runtime.gateway.tool_parsers import hermes, llama3_json, mistral, pythonic, qwen3_coder  # noqa: F401  (registration)
from runtime.gateway.tool_parsers.base import ParsedOutput, ToolParser, create_tool_parser, tool_parser_names

__all__ = ["ParsedOutput", "ToolParser", "create_tool_parser", "tool_parser_names"]
