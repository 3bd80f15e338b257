"""The bodies of POST /tokenize and POST /detokenize (vLLM's routes) as msgspec Structs. A chat body takes
what /v1/chat/completions renders the template with (tools, documents, chat_template_kwargs, ...), so its
count is the prompt that request would send."""

from __future__ import annotations

from typing import Any

from msgspec import Struct

from runtime.gateway.protocol import ChatMessage, Int64


class TokenizeBody(Struct, kw_only=True):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # The tokenizer's special tokens (BOS): vLLM's defaults, true for a prompt, false for messages (the
    # template writes its own), as the completions and chat routes encode them.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as in /v1/chat/completions: count what that request would send
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # rendered by the template as chat renders them
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None  # a 400, as on chat


class TokenizeResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeBody(Struct, kw_only=True):
    model: str | None = None
    tokens: list[Int64]


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str
