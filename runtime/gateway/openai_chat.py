"""POST /v1/chat/completions: OpenAI chat — messages through the model's chat template, n choices,
logprobs/top_logprobs, streaming (the role with the first content delta, content deltas, finish chunk,
optional usage, [DONE]).
OpenAI features Shoal lacks (tools, functions, JSON response formats, audio output) are a 400, never
silently ignored; fields Shoal does not know at all are ignored (protocol.py)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from msgspec import UNSET

from runtime.errors import ShoalError
from runtime.gateway.choice_state import ChoiceState
from runtime.gateway.errors import bad_request, from_shoal_error, not_supported
from runtime.gateway.generation import Generation
from runtime.gateway.openai_responder import OpenAIResponder
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
)
from runtime.messages import RequestOutput
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
    gen = await Generation.read(request, ChatCompletionRequest)
    body, client, state = gen.body, gen.client, gen.state
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
    gen.set_choices(base, state.choice_requests(client, base, [ids], params, n))
    return await gen.respond(bool(body.stream), _ChatResponder(gen, model, n, want_lp))


class _ChatResponder(OpenAIResponder):
    chunk_type = ChatCompletionChunk

    def __init__(self, gen: Generation, model: str, n: int, want_lp: bool):
        super().__init__(gen, model, n)
        self.want_lp = want_lp

    def body(self) -> ChatCompletionResponse:
        out = []
        for c in self.choices:
            lp = chat_logprobs(self.tokenizer, c.ids, c.logprobs, c.top_logprobs) if self.want_lp else None
            out.append(ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=lp,
                                            finish_reason=c.finish_reason, matched_stop=c.matched_stop))
        return ChatCompletionResponse(id=self.base, created=int(time.time()), model=self.model, choices=out,
                                      usage=self.usage(), system_fingerprint=self.fingerprint)

    def events(self, c: ChoiceState, out: RequestOutput, text: str) -> list[ChatCompletionChunk]:
        # The role goes with the first delta, which comes after prefill with the first token: a client
        # timing the first chunk measures the real time to first token.
        first = self.first_delta(c)
        lp = None
        if self.want_lp and out.new_token_ids:
            lp = chat_logprobs(self.tokenizer, out.new_token_ids, out.new_logprobs or [], out.new_top_logprobs)
        # The text before a stop string is final: its chunk carries the finish_reason. Other ends keep
        # OpenAI's separate empty-delta finish chunk.
        stop_end = c.done and c.detok.stopped
        events = []
        if first or text or lp is not None:
            events.append(self.chunk([ChatStreamChoice(
                index=c.index, delta=DeltaMessage(role="assistant" if first else UNSET, content=text), logprobs=lp,
                finish_reason=c.finish_reason if stop_end else None,
                matched_stop=c.matched_stop if stop_end else None)], self.chunk_usage()))
            if stop_end:
                return events
        if c.done:
            events.append(self.chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(),
                                                       finish_reason=c.finish_reason, matched_stop=c.matched_stop)],
                                     self.chunk_usage()))
        return events
