"""ChatRender: a chat through the model's template to token ids, as Tokenizer.apply_chat_template makes them,
split into its render and its encode so each runs where its size says. A template can write far more than
the body holds (Llama 3.x writes each tool's schema with tojson(indent=4): a 57 KB body of nested tools
rendered to 6.5M characters), so a chat with tools, documents or other structured template variables is
rendered on the tokenizer's worker thread, as is a large body's; a plain small chat renders here (its text
is about its messages' size), then is encoded off the loop only when its rendered text is large."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from runtime.gateway.prompt_input import OFF_LOOP_BYTES, input_size, off_loop
from runtime.gateway.reasoning_parsers.grammar_gate import turn_opening

Messages = list[dict[str, Any]]


class ChatRender(msgspec.Struct, frozen=True):
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] | None = None  # vLLM's chat_template_kwargs, documents among them
    add_special_tokens: bool = False  # the tokenizer's own (BOS) on top of what the template writes
    context_len: int | None = None  # a rendered chat certainly longer is refused before encoding...
    param: str = "messages"  # ...naming this field
    opening: bool = False  # also the turn's opening (turn_opening), which a reasoning parser reads

    def may_grow(self) -> bool:
        """Whether the template may write much more than the body holds: it renders tools and documents (and
        any structured variable) as JSON, indented by some templates to a size quadratic in their depth."""
        values = (self.template_kwargs or {}).values()
        return bool(self.tools) or any(isinstance(v, dict | list) for v in values)

    async def ids(self, request: web.Request, tok: Any, messages: Callable[[], Messages]) -> tuple[list[int], str]:
        """(token ids, turn opening or "") of the chat messages() makes (called where it renders: checking
        100k messages is work too). Raises ShoalError (InvalidRequestError, RequestAbortedError) or ApiError."""
        if self.may_grow() or input_size(request) > OFF_LOOP_BYTES:
            return await off_loop(request, tok, OFF_LOOP_BYTES + 1, lambda: self._ids(tok, *self.text(tok, messages())))
        text, opening = self.text(tok, messages())
        return await off_loop(request, tok, len(text), lambda: self._ids(tok, text, opening))

    def text(self, tok: Any, messages: Messages) -> tuple[str, str]:
        """(the template's text, the turn's opening or ""); the text checked against context_len."""
        if tok.is_null:  # no template to render: its apply_chat_template says so (a 400 naming messages)
            tok.apply_chat_template(messages)
        text = tok.render_chat(messages, self.add_generation_prompt, self.tools, self.continue_final_message,
                               self.template_kwargs)
        if self.context_len is not None:
            tok.check_length(text, self.context_len, self.param)
        opening = turn_opening(tok, messages, self.tools, self.add_generation_prompt, self.continue_final_message,
                               self.template_kwargs) if self.opening else ""
        return text, opening

    def _ids(self, tok: Any, text: str, opening: str) -> tuple[list[int], str]:
        return tok.encode(text, add_special_tokens=self.add_special_tokens), opening
