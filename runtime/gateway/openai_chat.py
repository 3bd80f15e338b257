"""POST /v1/chat/completions: OpenAI chat — messages through the model's chat template, n choices,
logprobs/top_logprobs, streaming (role chunk, content deltas, finish chunk, optional usage, [DONE]).
OpenAI features Shoal lacks (tools, functions, JSON response formats, audio output) are a 400, never
silently ignored; fields Shoal does not know at all are ignored (protocol.py)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from msgspec import UNSET

from runtime.engine_client import EngineClient
from runtime.errors import ShoalError
from runtime.gateway.body import read_body
from runtime.gateway.choice_state import ChoiceState, usage_info
from runtime.gateway.errors import ApiError, bad_request, from_shoal_error, not_supported
from runtime.gateway.fan_in import OutputFanIn
from runtime.gateway.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    encode,
)
from runtime.gateway.sse import SseWriter, is_disconnected
from runtime.gateway.state import STATE_KEY
from runtime.text.tokenizer import Tokenizer

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def check_unsupported(body: ChatCompletionRequest) -> None:
    if body.tools:
        raise not_supported("tool calling (tools)", "tools")
    if body.tool_choice is not None and body.tool_choice != "none":
        raise not_supported("tool_choice", "tool_choice")
    if body.functions:
        raise not_supported("function calling (functions)", "functions")
    if body.function_call is not None and body.function_call != "none":
        raise not_supported("function_call", "function_call")
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise not_supported(f"response_format {body.response_format.get('type')!r} (only 'text')",
                            "response_format")
    if body.modalities is not None and set(body.modalities) - {"text"}:
        raise not_supported(f"output modalities {body.modalities} (only ['text'])", "modalities")
    if body.audio is not None:
        raise not_supported("audio output (audio)", "audio")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: known roles, content flattened to one string."""
    if not messages:
        raise bad_request("messages must hold at least one message", param="messages")
    out = []
    for k, m in enumerate(messages):
        role = _ROLES.get(m.role)
        if role is None:
            what = "tool messages are" if m.role in ("tool", "function") else f"role {m.role!r} is"
            raise bad_request(f"messages[{k}]: {what} not supported (use system, user or assistant)",
                              param="messages")
        if m.tool_calls or m.function_call is not None or m.tool_call_id is not None:
            raise not_supported(f"messages[{k}]: tool calls", "messages")
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise not_supported(f"messages[{k}]: content part of type {part.get('type')!r} (only "
                                        f"'text' with a string 'text')", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            if role != "assistant":
                raise bad_request(f"messages[{k}]: content is required for role {m.role!r}", param="messages")
            content = ""
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def chat_logprobs(tokenizer: Tokenizer, ids: list[int], logprobs: list[float],
                  tops: list[list[tuple[int, float]]] | None) -> ChatChoiceLogprobs:
    def text(t: int) -> tuple[str, list[int]]:
        s = tokenizer.id_to_token_text(t)
        return s, list(s.encode("utf-8"))

    content = []
    for k, (t, lp) in enumerate(zip(ids, logprobs)):
        s, b = text(t)
        top = []
        for tt, tlp in tops[k] if tops else []:
            ts, tb = text(tt)
            top.append(ChatTopLogprob(token=ts, logprob=tlp, bytes=tb))
        content.append(ChatTokenLogprob(token=s, logprob=lp, bytes=b, top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    body = await read_body(request, ChatCompletionRequest)
    client = state.client()
    model = state.check_model(client, body.model)
    n = state.check_n(body.n)
    check_unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    try:
        ids = client.tokenizer.apply_chat_template(template_messages(body.messages))
    except ShoalError as e:
        raise from_shoal_error(e) from None
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_new is None:
        max_new = max(1, client.context_len - len(ids))
    want_lp = bool(body.logprobs)
    params = state.sampling_params(body, max_new, return_logprob=want_lp, top_logprobs_num=body.top_logprobs or 0,
                                   logprob_param="top_logprobs", max_param=max_param)
    base = state.new_id("chatcmpl")
    reqs = state.choice_requests(client, base, [ids], params, n)
    choices = [ChoiceState(i, r, client.tokenizer, state.metrics, arrival) for i, r in enumerate(reqs)]
    include_usage, continuous = state.usage_modes(body)
    tracked = state.track(base, reqs)
    try:
        if body.stream:
            return await _stream(request, client, base, model, choices, want_lp, n, include_usage, continuous)
        return await _complete(request, client, base, model, choices, want_lp, n)
    finally:
        state.untrack(base, tracked)


async def _complete(request: web.Request, client: EngineClient, base: str, model: str,
                    choices: list[ChoiceState], want_lp: bool, n: int) -> web.Response:
    async with OutputFanIn(client, [c.req for c in choices], lambda: is_disconnected(request)) as fan:
        async for i, out in fan:
            choices[i].add(out)
    out = []
    for c in choices:
        if c.error:
            raise ApiError(500, f"generation failed: {c.error}", code="engine_error")
        lp = chat_logprobs(client.tokenizer, c.ids, c.logprobs, c.top_logprobs) if want_lp else None
        out.append(ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=lp,
                                        finish_reason=c.finish_reason, matched_stop=c.matched_stop))
    resp = ChatCompletionResponse(id=base, created=int(time.time()), model=model, choices=out,
                                  usage=usage_info(choices, n))
    return web.Response(body=encode(resp), content_type="application/json")


async def _stream(request: web.Request, client: EngineClient, base: str, model: str, choices: list[ChoiceState],
                  want_lp: bool, n: int, include_usage: bool, continuous: bool = False) -> web.StreamResponse:
    sse = SseWriter(request)
    await sse.start()
    created = int(time.time())
    usage = None if include_usage else UNSET  # chunks carry usage: null only when it was asked for

    def chunk(choice: ChatStreamChoice) -> bytes:
        return encode(ChatCompletionChunk(id=base, created=created, model=model, choices=[choice],
                                          usage=usage_info(choices, n) if continuous else usage))

    try:
        for c in choices:
            await sse.send(chunk(ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))))
        async with OutputFanIn(client, [c.req for c in choices], lambda: is_disconnected(request)) as fan:
            async for i, out in fan:
                c = choices[i]
                text = c.add(out)
                if c.error:
                    raise ApiError(500, f"generation failed: {c.error}", code="engine_error")
                lp = None
                if want_lp and out.new_token_ids:
                    lp = chat_logprobs(client.tokenizer, out.new_token_ids, out.new_logprobs or [],
                                       out.new_top_logprobs)
                if text or lp is not None:
                    await sse.send(chunk(ChatStreamChoice(index=i, delta=DeltaMessage(content=text), logprobs=lp)))
                if c.finished:
                    await sse.send(chunk(ChatStreamChoice(index=i, delta=DeltaMessage(),
                                                          finish_reason=c.finish_reason,
                                                          matched_stop=c.matched_stop)))
        if include_usage:
            await sse.send(encode(ChatCompletionChunk(id=base, created=created, model=model, choices=[],
                                                      usage=usage_info(choices, n))))
        return await sse.finish()
    except (ApiError, ShoalError) as e:
        return await sse.end_on_error(e)
