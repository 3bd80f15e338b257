"""ChatRender: a chat through the model's template to token ids, as Tokenizer.apply_chat_template makes them,
split into its render and its encode so each runs where its size says. A template can write far more than
the body holds (Llama 3.x writes each tool's schema with tojson(indent=4): a 57 KB body of nested tools
rendered to 6.5M characters), so a small chat with tools, documents or other structured template variables is
rendered on the tokenizer worker's small lane (never behind a large body), and a large body's chat on its large
lane, as a render job sized by the body (all that is known before rendering); a plain small chat renders here
(its text is about its messages' size). A rendered text that is large is encoded on the large lane as a job of
its own, weighed by the text's characters: a template's growth is learned as the renders' rate, never as the
encodes' one that every large prompt is admitted by."""

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
        size = input_size(request)
        if size > OFF_LOOP_BYTES:
            text, opening = await off_loop(request, tok, size, lambda: self.text(tok, messages()), renders=True)
        elif self.may_grow():  # rendered on the small lane, and encoded there too unless its text grew large
            text, opening, ids = await off_loop(request, tok, size, lambda: self._small(tok, messages()), grows=True,
                                                renders=True)
            if ids is not None:
                return ids, opening
        else:
            text, opening = self.text(tok, messages())
        return await off_loop(request, tok, len(text), lambda: self._ids(tok, text, opening))

    def text(self, tok: Any, messages: Messages) -> tuple[str, str]:
        """(the template's text, the turn's opening or ""); the text checked against context_len."""
        text = tok.render_chat(messages, self.add_generation_prompt, self.tools, self.continue_final_message,
                               self.template_kwargs)
        if self.context_len is not None:
            tok.check_length(text, self.context_len, self.param)
        return text, self._opening(tok, messages, text)

    def _opening(self, tok: Any, messages: Messages, text: str) -> str:
        """turn_opening, with the generation prompt's render being text itself: one more render, not two."""
        if not self.opening:
            return ""
        full = text if self.add_generation_prompt and not self.continue_final_message else None
        return turn_opening(tok, messages, self.tools, self.add_generation_prompt, self.continue_final_message,
                            self.template_kwargs, rendered=full)

    def _small(self, tok: Any, messages: Messages) -> tuple[str, str, list[int] | None]:
        """text's (text, opening, ids), ids None where the text is large: then the large lane encodes it."""
        text, opening = self.text(tok, messages)
        return text, opening, None if len(text) > OFF_LOOP_BYTES else self._ids(tok, text, opening)[0]

    def _ids(self, tok: Any, text: str, opening: str) -> tuple[list[int], str]:
        return tok.encode(text, add_special_tokens=self.add_special_tokens), opening
