"""POST /v1/responses: OpenAI's Responses API (`client.responses.create`, agent frameworks) as vLLM and
SGLang serve it, on the chat machinery: instructions and input items through the model's chat template
(responses_input.py), text.format as structured output, function tools with tool_choice none / auto
(--tool-call-parser) / required / named, reasoning split out by --reasoning-parser into a reasoning item.

The answer is one Response object: a reasoning item, the assistant message (output_text) and
function_call items, status "completed" or "incomplete" (max_output_tokens), usage in the Responses
shape. Streamed, it is OpenAI's event sequence: response.created, response.in_progress, then per item
output_item.added, content_part.added, the text / reasoning / arguments deltas and their done events,
output_item.done, and last response.completed (response.incomplete on a length end) with the whole
Response. As on the other routes, the stream is `data:` events ending with [DONE] (the SDK stops there).

Shoal keeps no state: nothing is stored (store is accepted and echoed false), and what needs a stored
response (previous_response_id, conversation, item_reference, background) is a 400, as are built-in
tools and reasoning effort. One response a request: the API has no n."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from runtime.errors import ShoalError
from runtime.gateway.chat_output import ChatOutput
from runtime.gateway.choice_state import ChoiceState
from runtime.gateway.errors import ApiError, bad_request, from_shoal_error
from runtime.gateway.generation import Generation, Responder
from runtime.gateway.openai_chat import gate_grammar, template_messages
from runtime.gateway.protocol import OpenAISamplingFields
from runtime.gateway.reasoning_parsers import create_reasoning_parser
from runtime.gateway.reasoning_parsers.base import THINK_CLOSE
from runtime.gateway.reasoning_parsers.grammar_gate import AnswerOnlyParser, turn_opening
from runtime.gateway.responses_input import (
    check_unsupported,
    format_constraint,
    input_messages,
    tool_request,
)
from runtime.gateway.responses_output import ResponseItems, new_id
from runtime.gateway.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from runtime.gateway.tool_request import ToolRequest
from runtime.messages import RequestOutput

# The sampling fields of a Responses body that mean what they mean on chat (GatewayState.sampling_params).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "skip_special_tokens")


async def responses(request: web.Request) -> web.StreamResponse:
    gen = await Generation.read(request, ResponsesRequest)
    body, client, state = gen.body, gen.client, gen.state
    model = state.check_model(client, body.model)
    check_unsupported(body)
    tools = tool_request(body, state.args.tool_call_parser)
    constraint = format_constraint(body.text)
    tool_constraint = tools.constraint() if tools is not None else None
    if constraint is not None and tool_constraint is not None:
        raise bad_request(f"{constraint.param} cannot be combined with tool_choice {tools.mode!r}",
                          param=constraint.param)
    constraint = constraint or tool_constraint
    messages = input_messages(body)
    try:
        rendered = template_messages(messages)
    except ApiError as e:  # worded for chat's messages; here they are the instructions and input items
        e.param = "input"
        raise
    template_tools = tools.template_tools() if tools is not None else None
    try:
        ids = client.tokenizer.apply_chat_template(rendered, tools=template_tools,
                                                   template_kwargs=body.chat_template_kwargs)
        opening = turn_opening(client.tokenizer, rendered, template_tools, True, False, body.chat_template_kwargs) \
            if state.args.reasoning_parser is not None else ""
    except ShoalError as e:
        raise from_shoal_error(e) from None
    max_new = body.max_output_tokens
    if max_new is None:
        max_new = max(1, client.context_len - len(ids))
    fields = OpenAISamplingFields(**{f: getattr(body, f) for f in _SAMPLING_FIELDS})
    params = state.sampling_params(fields, max_new, max_param="max_output_tokens")
    reasoning, reasoning_done = state.args.reasoning_parser, False
    if constraint is not None:
        params = constraint.apply(params)
        if reasoning is not None:
            params, reasoning, reasoning_done = gate_grammar(client.tokenizer, opening, params, constraint, reasoning)
    base = new_id("resp")
    reqs = state.choice_requests(client, base, [ids], params, 1)
    if constraint is not None:
        await state.check_grammar(client, reqs[0], constraint.param)
    gen.set_choices(base, reqs)
    responder = _ResponsesResponder(gen, model, _echo(body), tools, reasoning, reasoning_done)
    return await gen.respond(bool(body.stream), responder)


def _echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as the Response object repeats them."""
    text: dict[str, Any] = {"format": (body.text.format if body.text and body.text.format else {"type": "text"})}
    if body.text is not None and body.text.verbosity is not None:
        text["verbosity"] = body.text.verbosity
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False, "text": text,
            "metadata": body.metadata or {}, "user": body.user}


class _ResponsesResponder(Responder):
    def __init__(self, gen: Generation, model: str, echo: dict[str, Any], tools: ToolRequest | None,
                 reasoning: str | None, reasoning_done: bool):
        """reasoning_done: the prompt closed the reasoning, so the whole output is the answer."""
        self.choice: ChoiceState = gen.choices[0]
        self.tokenizer = gen.client.tokenizer
        self.id, self.model, self.echo = gen.base_id, model, echo
        self.created = int(time.time())
        self.tools, self.reasoning, self.reasoning_done = tools, reasoning, reasoning_done
        self.output = self._chat_output()  # the stream's parse; body() parses the final text afresh
        self.items = ResponseItems()
        self.started = False

    def _chat_output(self) -> ChatOutput:
        parser = None
        if self.reasoning:
            parser = AnswerOnlyParser() if self.reasoning_done else create_reasoning_parser(self.reasoning)
        return ChatOutput(parser, self.tools.parser() if self.tools is not None else None)

    @property
    def incomplete(self) -> bool:
        return self.choice.finish_reason == "length"

    def _response(self, status: str, items: ResponseItems | None = None,
                  output: ChatOutput | None = None) -> ResponseObject:
        """The Response object: in progress (no output yet), or final with its items and usage."""
        if items is None:
            return ResponseObject(id=self.id, created_at=self.created, model=self.model, status=status, output=[],
                                  **self.echo)
        c = self.choice
        usage = ResponseUsage(
            input_tokens=c.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=c.cached_tokens),
            output_tokens=c.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self._reasoning_tokens(output)),
            total_tokens=c.prompt_tokens + c.completion_tokens)
        return ResponseObject(
            id=self.id, created_at=self.created, model=self.model, status=status, output=items.output(),
            usage=usage, completed_at=int(time.time()),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if self.incomplete else None,
            **self.echo)

    def _reasoning_tokens(self, output: ChatOutput | None) -> int:
        """Output tokens up to and including </think> (all of them when the output ended inside it)."""
        if output is None or not output.reasoning:
            return 0
        ids = self.choice.ids
        end = self.tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
        if len(end) == 1 and end[0] in ids:
            return ids.index(end[0]) + 1
        if not output.content and not output.parsed.calls:
            return len(ids)
        return min(len(ids), len(self.tokenizer.encode(output.reasoning, add_special_tokens=False)))

    def body(self) -> ResponseObject:
        output, items = self._chat_output(), ResponseItems()
        items.feed(output.update(self.choice.text, final=True))
        items.finish(self.incomplete)
        return self._response("incomplete" if self.incomplete else "completed", items, output)

    def _start(self) -> list[ResponseEvent]:
        self.started = True
        return [ResponseEvent(type=kind, sequence_number=self.items.next_seq(), response=self._response("in_progress"))
                for kind in ("response.created", "response.in_progress")]

    def events(self, c: ChoiceState, out: RequestOutput, text: str) -> list[Any]:
        # response.created goes with the first delta, after prefill (as chat's role does): a client timing
        # the first event measures the real time to first token.
        events: list[Any] = [] if self.started else self._start()
        return events + self.items.feed(self.output.update(c.text, final=c.done))

    def last_events(self) -> list[Any]:
        events: list[Any] = [] if self.started else self._start()
        events += self.items.finish(self.incomplete)
        status = "incomplete" if self.incomplete else "completed"
        events.append(ResponseEvent(type=f"response.{status}", sequence_number=self.items.next_seq(),
                                    response=self._response(status, self.items, self.output)))
        return events
