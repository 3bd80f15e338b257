"""POST /tokenize and POST /detokenize, as vLLM serves them: count a prompt's tokens (or a chat's, through
the chat template with its tools and documents, as /v1/chat/completions renders it) without generating,
and turn token ids back into text."""

from __future__ import annotations

from aiohttp import web

from runtime.errors import ShoalError
from runtime.gateway.body import read_body
from runtime.gateway.chat_render import ChatRender
from runtime.gateway.errors import bad_request, from_shoal_error, not_supported
from runtime.gateway.extension_fields import template_kwargs
from runtime.gateway.openai_chat import template_messages
from runtime.gateway.prompt_input import off_loop
from runtime.gateway.protocol import encode
from runtime.gateway.state import STATE_KEY
from runtime.gateway.tokenize_protocol import (
    DetokenizeBody,
    DetokenizeResponse,
    TokenizeBody,
    TokenizeResponse,
)
from runtime.gateway.tool_request import ToolRequest


def _json(obj: object) -> web.Response:
    return web.Response(body=encode(obj), content_type="application/json")


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await read_body(request, TokenizeBody)
    client = state.client()
    state.check_model(client, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    tok = client.tokenizer
    context = client.context_len
    try:
        if body.prompt is not None:
            chat_only = next((f for f in ("tools", "documents", "chat_template_kwargs", "chat_template")
                             if getattr(body, f)), None)
            if chat_only is not None:
                raise bad_request(f"{chat_only} goes with messages (a chat), not with prompt", param=chat_only)
            special = body.add_special_tokens is not False
            # vLLM counts any length here; a text certainly past the context is refused before encoding, as
            # the generating routes refuse it (8 MB would take the tokenizer seconds to count)
            tok.check_length(body.prompt, context, "prompt")
            ids = await off_loop(request, tok, len(body.prompt),
                                 lambda: tok.encode(body.prompt, add_special_tokens=special))
        else:
            ids, _ = await _chat(body, context).ids(request, tok, lambda: template_messages(body.messages))
    except ShoalError as e:
        raise from_shoal_error(e) from None
    return _json(TokenizeResponse(count=len(ids), max_model_len=client.context_len, tokens=ids))


def _chat(body: TokenizeBody, context_len: int) -> ChatRender:
    """The messages' template call as /v1/chat/completions makes it (tool_choice aside: every mode hands the
    template the same tools)."""
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true: set "
                          "add_generation_prompt to false", param="continue_final_message")
    if body.chat_template is not None:
        raise not_supported("a per-request chat_template (the server's template renders every chat)",
                            "chat_template")
    tools = ToolRequest.from_body(body.tools, "none", None, None)
    return ChatRender(body.add_generation_prompt, tools.template_tools() if tools is not None else None,
                      body.continue_final_message, template_kwargs(body.documents, body.chat_template_kwargs),
                      bool(body.add_special_tokens), context_len)


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await read_body(request, DetokenizeBody)
    client = state.client()
    state.check_model(client, body.model)
    tok = client.tokenizer
    if tok.is_null:
        raise bad_request("this model folder has no tokenizer: token ids cannot become text", param="tokens")
    vocab = tok.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return _json(DetokenizeResponse(prompt=tok.decode(body.tokens, skip_special_tokens=False)))
