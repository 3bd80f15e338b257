"""POST /tokenize and POST /detokenize, as vLLM serves them: count a prompt's tokens (or a chat's, through
the chat template) without generating, and turn token ids back into text."""

from __future__ import annotations

from aiohttp import web

from runtime.errors import ShoalError
from runtime.gateway.body import read_body
from runtime.gateway.errors import bad_request, from_shoal_error
from runtime.gateway.openai_chat import template_messages
from runtime.gateway.protocol import (
    DetokenizeBody,
    DetokenizeResponse,
    TokenizeBody,
    TokenizeResponse,
    encode,
)
from runtime.gateway.state import STATE_KEY


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
    try:
        if body.prompt is not None:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            if body.continue_final_message and body.add_generation_prompt:
                raise bad_request("continue_final_message and add_generation_prompt cannot both be true: set "
                                  "add_generation_prompt to false", param="continue_final_message")
            ids = tok.apply_chat_template(template_messages(body.messages),
                                          add_generation_prompt=body.add_generation_prompt,
                                          continue_final_message=body.continue_final_message,
                                          template_kwargs=body.chat_template_kwargs)
    except ShoalError as e:
        raise from_shoal_error(e) from None
    return _json(TokenizeResponse(count=len(ids), max_model_len=client.context_len, tokens=ids))


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
