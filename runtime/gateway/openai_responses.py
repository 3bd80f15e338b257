"""POST /v1/responses: OpenAI's Responses API (`client.responses.create`, agent frameworks) as vLLM and
SGLang serve it, on the chat machinery: instructions and input items through the model's chat template
(responses_input.py), text.format as structured output, function tools with tool_choice none / auto
(--tool-call-parser) / required / named, reasoning split out by --reasoning-parser into a reasoning item,
and include ["message.output_text.logprobs"] (with top_logprobs alternatives) as the output_text's logprobs.
Chat's extras mean here what they mean there: the sampling knobs, logit_bias, include_stop_str_in_output
(SGLang's no_stop_trim), truncate_prompt_tokens, documents, add_special_tokens, SGLang's lora_path, the
structured-output fields (SGLang's json_schema too; one constraint at most, text.format included), and
chat's refusals (beam search, logits processors, stop_regex, structural_tag, a per-request chat_template:
extension_fields.check_unhonoured) are 400s here too.

The answer is one Response object: a reasoning item, the assistant message (output_text) and
function_call items, status "completed" or "incomplete" (max_output_tokens), usage in the Responses
shape. Streamed, it is OpenAI's event sequence, each event named (Responder.named_events): response.created
and response.in_progress at once, then per item output_item.added, content_part.added, the text / reasoning
/ arguments deltas and their done events, output_item.done, and last response.completed
(response.incomplete on a length end) with the whole Response; every event numbered by sequence_number.

A last input item that is an assistant message of status in_progress or incomplete is continued (the
prompt ends inside it, no new turn opened), as vLLM continues it; the output is the continuation.

Shoal keeps no state: nothing is stored (store is accepted and echoed false), and what needs a stored
response (previous_response_id, conversation, item_reference, background) is a 400, as are built-in
tools. reasoning.effort is accepted and ignored (logged and counted), as vLLM accepts it: the models
Shoal serves have no effort knob. One response a request: the API has no n (n other than 1 is a 400, as
are chat's other fields a Response names otherwise, max_tokens or logprobs: responses_input.py)."""
from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from runtime.errors import ShoalError
from runtime.gateway.chat_output import ChatDelta, ChatOutput
from runtime.gateway.chat_render import ChatRender
from runtime.gateway.choice_state import ChoiceState
from runtime.gateway.errors import ApiError, bad_request, from_shoal_error
from runtime.gateway.extension_fields import check_unhonoured, keeps_stop_str, request_lora, template_kwargs
from runtime.gateway.generation import Generation, Responder
from runtime.gateway.openai_chat import chat_logprobs, constrain, template_messages, with_priority
from runtime.gateway.prompt_input import truncate_prompt
from runtime.gateway.protocol import ChatTokenLogprob, ErrorInfo, OpenAISamplingFields
from runtime.gateway.reasoning_parsers import create_reasoning_parser
from runtime.gateway.reasoning_parsers.base import THINK_CLOSE
from runtime.gateway.reasoning_parsers.grammar_gate import AnswerOnlyParser
from runtime.gateway.responses_input import (
    check_unsupported,
    continues_final_message,
    format_constraint,
    ignored_reasoning,
    input_messages,
    output_constraint,
    tool_request,
    wants_logprobs,
)
from runtime.gateway.responses_output import ResponseItems
from runtime.gateway.responses_protocol import (
    ErrorEvent,
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from runtime.gateway.responses_token_ends import TokenTextEnds
from runtime.gateway.tool_request import ToolRequest
from runtime.messages import RequestOutput
from runtime.sampling.params import SamplingParams

# The fields of a Responses body that mean what they mean on chat, read by chat's own code: the sampling
# knobs (GatewayState.sampling_params), the structured-output ones (joining text.format:
# responses_input.output_constraint), and the extension fields (extension_fields.py).
_CHAT_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
                "skip_special_tokens", "allowed_token_ids", "bad_words", "logit_bias", "regex", "ebnf", "json_schema",
                "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                "include_stop_str_in_output", "no_stop_trim", "lora_path", "use_beam_search", "length_penalty",
                "logits_processors", "custom_logit_processor", "structural_tag", "stop_regex")


async def responses(request: web.Request) -> web.StreamResponse:
    gen = await Generation.read(request, ResponsesRequest)
    body, client, state = gen.body, gen.client, gen.state
    model = state.check_model(client, body.model)
    check_unsupported(body)
    fields = OpenAISamplingFields(**{f: getattr(body, f) for f in _CHAT_FIELDS})
    check_unhonoured(fields)
    state.ignored_fields.count(ignored_reasoning(body), request.path)
    want_lp = wants_logprobs(body)
    lora = request_lora(state, fields)
    tools = tool_request(body, state.args.tool_call_parser)
    constraint = output_constraint(format_constraint(body.text), fields)
    tool_constraint = tools.constraint() if tools is not None else None
    if constraint is not None and tool_constraint is not None:
        raise bad_request(f"{constraint.param} cannot be combined with tool_choice {tools.mode!r}",
                          param=constraint.param)
    constraint = constraint or tool_constraint
    cont = continues_final_message(body)
    template_tools = tools.template_tools() if tools is not None else None
    kwargs = template_kwargs(body.documents, body.chat_template_kwargs)
    bound = None if body.truncate_prompt_tokens is not None else client.context_len

    def messages() -> list[dict[str, Any]]:
        try:
            return template_messages(input_messages(body))
        except ApiError as e:  # worded for chat's messages; here they are the instructions and input items
            e.param = "input"
            raise

    # the rendered items are the input, not chat's messages: a chat certainly past the context names it
    chat = ChatRender(not cont, template_tools, cont, kwargs, bool(body.add_special_tokens), bound, param="input",
                      opening=state.args.reasoning_parser is not None)
    try:  # 100k input items (or nested tools) render on the tokenizer's thread, not on the shared loop
        ids, opening = await chat.ids(request, client.tokenizer, messages)
    except ShoalError as e:
        raise from_shoal_error(e) from None
    ids = truncate_prompt(ids, body.truncate_prompt_tokens, client.context_len)
    max_new = body.max_output_tokens
    if max_new is None:
        max_new = max(1, client.context_len - len(ids))
    params = state.sampling_params(fields, max_new, return_logprob=want_lp, top_logprobs_num=body.top_logprobs or 0,
                                   logprob_param="top_logprobs", max_param="max_output_tokens",
                                   max_given=body.max_output_tokens is not None)
    if keeps_stop_str(fields):
        params = msgspec.structs.replace(params, include_stop_str_in_output=True)
    params, reasoning, reasoning_done = constrain(client.tokenizer, opening, params, constraint,
                                                  state.args.reasoning_parser)
    # vLLM answers with the body's request_id verbatim (its default is resp_<uuid>), whatever X-Request-Id
    # says; without one, X-Request-Id names it resp_<header> as on the other routes
    base = state.new_id("resp", "_", body.request_id, as_sent=True)
    reqs = with_priority(state, client, state.choice_requests(client, base, [ids], params, 1, lora_name=lora,
                                                              cache_salt=body.cache_salt), body.priority)
    if constraint is not None:
        await state.check_grammar(client, reqs[0], constraint.param, request)
    gen.set_choices(base, reqs)
    responder = _ResponsesResponder(gen, model, _echo(body, params), tools, reasoning, reasoning_done, want_lp)
    return await gen.respond(bool(body.stream), responder)


def _echo(body: ResponsesRequest, params: SamplingParams) -> dict[str, Any]:
    """The request's settings as the Response object repeats them; temperature and top_p as sampled with (the
    body's, else the model's defaults), as vLLM's and OpenAI's, never null."""
    text: dict[str, Any] = {"format": (body.text.format if body.text and body.text.format else {"type": "text"})}
    if body.text is not None and body.text.verbosity is not None:
        text["verbosity"] = body.text.verbosity
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False, "text": text,
            "metadata": body.metadata or {}, "user": body.user, "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key, "top_logprobs": body.top_logprobs,
            "reasoning": msgspec.structs.asdict(body.reasoning) if body.reasoning is not None else None}


class _ResponsesResponder(Responder):
    named_events = True

    def __init__(self, gen: Generation, model: str, echo: dict[str, Any], tools: ToolRequest | None,
                 reasoning: str | None, reasoning_done: bool, want_lp: bool):
        """reasoning_done: the prompt closed the reasoning, so the whole output is the answer."""
        self.choice: ChoiceState = gen.choices[0]
        self.tokenizer = gen.client.tokenizer
        self.id, self.model, self.echo = gen.base_id, model, echo
        self.created = int(time.time())
        self.tools, self.reasoning, self.reasoning_done = tools, reasoning, reasoning_done
        self.output = self._chat_output()  # the stream's parse; body() parses the final text afresh
        self.items = ResponseItems()
        self.want_lp = want_lp
        self._lp_next = 0  # the stream's first output token not yet given to a text delta
        self._answer_from: int | None = None  # the first token after </think>, once found
        self._ends = TokenTextEnds(self.tokenizer, self.choice.req.sampling_params.skip_special_tokens)

    def _chat_output(self) -> ChatOutput:
        parser = None
        if self.reasoning:
            parser = AnswerOnlyParser() if self.reasoning_done else create_reasoning_parser(self.reasoning)
        return ChatOutput(parser, self.tools.parser() if self.tools is not None else None)

    @property
    def incomplete(self) -> bool:
        return self.choice.finish_reason == "length"

    def _response(self, status: str, items: ResponseItems | None = None, output: ChatOutput | None = None,
                  error: ResponseError | None = None) -> ResponseObject:
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
            usage=usage, completed_at=int(time.time()) if status == "completed" else None, error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
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

    # ---- logprobs: those of the tokens behind the message's text ----------------------------------
    def _logprobs(self, start: int, end: int) -> list[ChatTokenLogprob]:
        c = self.choice
        tops = c.top_logprobs[start:end] if c.top_logprobs else None
        return chat_logprobs(self.tokenizer, c.ids[start:end], c.logprobs[start:end], tops).content or []

    def _answer_start(self, output: ChatOutput) -> int:
        """The first token after the one that completed </think> (0 where no reasoning came before the
        answer); found once, by the text, however the model spelt the tag in tokens."""
        if not self.reasoning or self.reasoning_done:
            return 0
        if self._answer_from is None:
            text = self.choice.text
            if not (0 <= text.find(THINK_CLOSE) < len(text) - len(output.content)):
                return 0
            ids = self.choice.ids
            at = self._ends.text(ids).find(THINK_CLOSE)  # the choice's text, but never cut by a stop string
            self._answer_from = self._ends.first_reaching(ids, at + len(THINK_CLOSE), 1)
        return self._answer_from

    def _message_end(self, output: ChatOutput, start: int, sent: int) -> int:
        """Where the message's tokens end so far: at the last token, or where a tool parser reads the
        text (a call may follow), at the fewest tokens past `sent` whose text reaches the message's."""
        ids = self.choice.ids
        if output.tool_parser is None:
            return len(ids)
        text, content = self._ends.text(ids), output.content
        head = self._ends.ends[start]
        # The message starts where the answer does, but past any whitespace the parsers dropped (a
        # reasoning parser drops what follows </think>; a tool parser alone keeps it).
        while head < len(text) and text[head].isspace() and not text.startswith(content, head):
            head += 1
        return self._ends.first_reaching(ids, head + len(content), sent + 1)

    def _body_logprobs(self, output: ChatOutput) -> list[ChatTokenLogprob] | None:
        """The tokens after the reasoning and before any function call (at the end, the tokens that
        showed no text of their own, such as a stop string's, are the message's too)."""
        if not self.want_lp or not output.content:
            return None
        start = self._answer_start(output)
        end = self._message_end(output, start, start) if output.parsed.calls else len(self.choice.ids)
        return self._logprobs(start, end)

    def _delta_logprobs(self, d: ChatDelta, c: ChoiceState) -> list[ChatTokenLogprob] | None:
        """A text delta's: the message's tokens not yet sent (so also those that showed nothing yet: a
        held back stop-string prefix, a partial character), as the body counts them."""
        if not self.want_lp or not d.content:
            return None
        start = max(self._lp_next, self._answer_start(self.output))
        self._lp_next = max(start, self._message_end(self.output, self._answer_start(self.output), start))
        return self._logprobs(start, self._lp_next)

    # ---- the answer -------------------------------------------------------------------------------
    def body(self) -> ResponseObject:
        output, items = self._chat_output(), ResponseItems()
        d = output.update(self.choice.text, final=True)
        items.feed(d, self._body_logprobs(output))
        items.finish(self.incomplete)
        return self._response("incomplete" if self.incomplete else "completed", items, output)

    def first_events(self) -> list[ResponseEvent]:
        return [ResponseEvent(type=kind, sequence_number=self.items.next_seq(), response=self._response("in_progress"))
                for kind in ("response.created", "response.in_progress")]

    def events(self, c: ChoiceState, out: RequestOutput, text: str) -> list[Any]:
        d = self.output.update(c.text, final=c.done)
        events = self.items.feed(d, self._delta_logprobs(d, c))
        if c.done and self.want_lp and self.items.open_kind == "message":
            # Tokens that ended the text without showing any (an end token, a stop string) are still its own.
            start, self._lp_next = max(self._lp_next, self._answer_start(self.output)), len(c.ids)
            if start < len(c.ids):
                events += self.items.text_delta("", self._logprobs(start, len(c.ids)))
        return events

    def last_events(self) -> list[Any]:
        events = self.items.finish(self.incomplete)
        status = "incomplete" if self.incomplete else "completed"
        events.append(ResponseEvent(type=f"response.{status}", sequence_number=self.items.next_seq(),
                                    response=self._response(status, self.items, self.output)))
        return events

    def failed_events(self, error: ApiError) -> list[Any]:
        """OpenAI's error event (with the usual error object, which the openai SDK raises), then
        response.failed with what was made so far."""
        info = ErrorInfo(error.message, error.type, error.param, error.code)
        events: list[Any] = [ErrorEvent(sequence_number=self.items.next_seq(), code=error.code,
                                        message=error.message, param=error.param, error=info)]
        self.items.abandon()
        failure = ResponseError(code="server_error" if error.status >= 500 else "invalid_prompt",
                                message=error.message)
        events.append(ResponseEvent(type="response.failed", sequence_number=self.items.next_seq(),
                                    response=self._response("failed", self.items, self.output, failure)))
        return events
