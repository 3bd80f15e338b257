"""POST /v1/chat/completions: OpenAI chat — messages (tool calls and tool results included) through the
model's chat template with the request's tools, n choices, logprobs/top_logprobs, structured output
(response_format, regex, ebnf, vLLM's guided_* / structured_outputs), tool calls (tool_choice none / auto
/ required / named) and reasoning content (--reasoning-parser: a grammar then waits for </think>, as in
vLLM and SGLang), streaming (the role with the first delta, content / reasoning_content / tool_calls
deltas, finish chunk, optional usage, [DONE]). vLLM's chat
extensions: chat_template_kwargs, documents, add_generation_prompt, continue_final_message,
add_special_tokens, truncate_prompt_tokens, include_stop_str_in_output, prompt_logprobs (on the response,
not per choice, as vLLM answers it), return_token_ids, return_tokens_as_token_ids; an assistant message's
reasoning / reasoning_content reaches the template; SGLang's json_schema, no_stop_trim and lora_path
(extension_fields.py). OpenAI features Shoal lacks (legacy functions, audio output) and vLLM / SGLang
fields it cannot honour (beam search, logits processors, a per-request chat_template, ...) are a 400, never
silently ignored; fields Shoal does not know at all are ignored (protocol.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
from aiohttp import web
from msgspec import UNSET, UnsetType

from runtime.engine_client import EngineClient
from runtime.errors import ShoalError
from runtime.gateway.chat_output import ChatOutput
from runtime.gateway.chat_render import ChatRender
from runtime.gateway.choice_state import ChoiceState
from runtime.gateway.errors import bad_request, from_shoal_error, not_supported
from runtime.gateway.extension_fields import check_unhonoured, keeps_stop_str, request_lora, template_kwargs
from runtime.gateway.generation import Generation
from runtime.gateway.openai_responder import OpenAIResponder, prompt_logprobs_num, score_prompts_once
from runtime.gateway.output_constraint import OutputConstraint
from runtime.gateway.prompt_input import truncate_prompt
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
from runtime.gateway.reasoning_parsers import create_reasoning_parser, reasoning_tags
from runtime.gateway.reasoning_parsers.grammar_gate import AnswerOnlyParser, grammar_gate
from runtime.gateway.state import GatewayState
from runtime.gateway.tool_request import ToolRequest
from runtime.messages import GenerateRequest, RequestOutput
from runtime.sampling.params import SamplingParams
from runtime.text.tokenizer import Tokenizer

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def check_unsupported(body: ChatCompletionRequest, n: int) -> None:
    check_unhonoured(body)
    if body.best_of is not None and body.best_of != n:
        raise not_supported("best_of other than n", "best_of")
    if body.echo:
        raise not_supported("echo on chat (/v1/completions echoes its prompt)", "echo")
    if body.chat_template is not None:
        # vLLM takes one only behind --trust-request-chat-template: a template is code the server runs
        raise not_supported("a per-request chat_template (the server's template renders every chat)",
                            "chat_template")
    if body.functions:
        raise not_supported("function calling (functions)", "functions")
    if body.function_call is not None and body.function_call != "none":
        raise not_supported("function_call", "function_call")
    if body.modalities is not None and set(body.modalities) - {"text"}:
        raise not_supported(f"output modalities {body.modalities} (only ['text'])", "modalities")
    if body.audio is not None:
        raise not_supported("audio output (audio)", "audio")
    if body.continue_final_message and body.add_generation_prompt:
        # vLLM's rule: a continued message gets no assistant header after it, and the default is true.
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true: set "
                          "add_generation_prompt to false", param="continue_final_message")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: known roles, content flattened to one string."""
    if not messages:
        raise bad_request("messages must hold at least one message", param="messages")
    out = []
    for k, m in enumerate(messages):
        role = _ROLES.get(m.role)
        if role is None:
            what = "function messages are" if m.role == "function" else f"role {m.role!r} is"
            raise bad_request(f"messages[{k}]: {what} not supported (use {', '.join(_ROLES)})",
                              param="messages")
        if m.function_call is not None:
            raise not_supported(f"messages[{k}]: function_call (use tool_calls)", "messages")
        if m.tool_calls and role != "assistant":
            raise bad_request(f"messages[{k}]: only assistant messages carry tool_calls", param="messages")
        reasoning = _reasoning(k, m, role)
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise not_supported(f"messages[{k}]: content part of type {part.get('type')!r} (only "
                                        f"'text' with a string 'text')", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if content is None:
            if role != "assistant" or not m.tool_calls:
                raise bad_request(f"messages[{k}]: content is required for role {m.role!r}", param="messages")
            content = ""
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [_template_tool_call(k, i, c) for i, c in enumerate(m.tool_calls)]
        if reasoning is not None:  # both names, as vLLM passes them: templates read one or the other
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        if role == "tool":
            if not isinstance(m.tool_call_id, str):
                raise bad_request(f"messages[{k}]: a tool message needs the tool_call_id it answers",
                                  param="messages")
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _reasoning(k: int, m: ChatMessage, role: str) -> str | None:
    """An assistant message's earlier reasoning (vLLM's `reasoning`, SGLang's and Qwen's `reasoning_content`)."""
    if m.reasoning is None and m.reasoning_content is None:
        return None
    if role != "assistant":
        raise bad_request(f"messages[{k}]: only assistant messages carry reasoning", param="messages")
    if None not in (m.reasoning, m.reasoning_content) and m.reasoning != m.reasoning_content:
        raise bad_request(f"messages[{k}]: reasoning and reasoning_content differ: give one", param="messages")
    return m.reasoning if m.reasoning is not None else m.reasoning_content


def _template_tool_call(k: int, i: int, call: Any) -> dict[str, Any]:
    """An assistant message's tool call as chat templates want it: arguments as an object (HF convention)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"messages[{k}].tool_calls[{i}] must be {{id, type, function: {{name, arguments}}}}",
                          param="messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_request(f"messages[{k}].tool_calls[{i}].function.arguments is not valid JSON",
                              param="messages") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def chat_logprobs(tokenizer: Tokenizer, ids: list[int], logprobs: list[float],
                  tops: list[list[tuple[int, float]]] | None, as_ids: bool = False) -> ChatChoiceLogprobs:
    """as_ids: vLLM's return_tokens_as_token_ids, each token named "token_id:N" (bytes: that name's)."""
    def text(t: int) -> tuple[str, list[int]]:
        if as_ids:
            name = f"token_id:{t}"
            return name, list(name.encode())
        # The token's own bytes, not its text's: a token holding part of a character decodes to "\ufffd".
        return tokenizer.id_to_token_text(t), list(tokenizer.id_to_token_bytes(t))

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
    check_unsupported(body, n)
    prompt_lp = prompt_logprobs_num(body)
    if body.top_logprobs and not body.logprobs:  # 0 asks for nothing: accepted alone, as vLLM does
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    tools = ToolRequest.from_body(body.tools, body.tool_choice, body.parallel_tool_calls, state.args.tool_call_parser)
    constraint = OutputConstraint.from_body(body)
    tool_constraint = tools.constraint() if tools is not None else None
    if constraint is not None and tool_constraint is not None:
        raise bad_request(f"{constraint.param} cannot be combined with tool_choice {tools.mode!r}",
                          param=constraint.param)
    constraint = constraint or tool_constraint
    template_tools = tools.template_tools() if tools is not None else None
    kwargs = template_kwargs(body.documents, body.chat_template_kwargs)
    bound = None if body.truncate_prompt_tokens is not None else client.context_len

    chat = ChatRender(body.add_generation_prompt, template_tools, body.continue_final_message, kwargs,
                      bool(body.add_special_tokens), bound, opening=state.args.reasoning_parser is not None)
    try:  # a large chat (100k messages, nested tools) renders on the tokenizer's thread, not on the shared loop
        ids, opening = await chat.ids(request, client.tokenizer, lambda: template_messages(body.messages))
    except ShoalError as e:
        raise from_shoal_error(e) from None
    ids = truncate_prompt(ids, body.truncate_prompt_tokens, client.context_len)
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_new is None:
        max_new = max(1, client.context_len - len(ids))
    want_lp = bool(body.logprobs)
    params = state.sampling_params(body, max_new, return_logprob=want_lp, top_logprobs_num=body.top_logprobs or 0,
                                   logprob_param="top_logprobs", max_param=max_param)
    if keeps_stop_str(body):
        params = msgspec.structs.replace(params, include_stop_str_in_output=True)
    if body.skip_special_tokens is None and _mistral_markers(state, tools):
        # [THINK] / [TOOL_CALLS] are control tokens of Mistral's tokenizers (v11+): the parsers must see them,
        # as vLLM keeps them for its Mistral parsers
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    params, reasoning, reasoning_done = constrain(client.tokenizer, opening, params, constraint,
                                                  state.args.reasoning_parser)
    base = state.new_id("chatcmpl", request_id=body.request_id)
    reqs = state.choice_requests(client, base, [ids], params, n, return_input_logprob=prompt_lp is not None,
                                 input_top_logprobs_num=prompt_lp or 0, lora_name=request_lora(state, body),
                                 cache_salt=body.cache_salt)
    reqs = with_priority(state, client, reqs, body.priority)
    if prompt_lp is not None:
        reqs = score_prompts_once(reqs, n)
    if constraint is not None:
        await state.check_grammar(client, reqs[0], constraint.param, request)
    gen.set_choices(base, reqs)
    responder = _ChatResponder(gen, model, n, want_lp, tools, reasoning, reasoning_done, prompt_lp)
    return await gen.respond(bool(body.stream), responder)


def _mistral_markers(state: GatewayState, tools: ToolRequest | None) -> bool:
    """A Mistral parser reads this request's output: --reasoning-parser mistral, or --tool-call-parser mistral
    with tool_choice auto."""
    return state.args.reasoning_parser == "mistral" or (
        tools is not None and tools.mode == "auto" and tools.parser_name == "mistral")


def with_priority(state: GatewayState, client: EngineClient, reqs: list[GenerateRequest], priority: int | None) -> list[GenerateRequest]:
    """The body's `priority` on each of its requests, checked again by the engine's own rules: a 400 naming
    it where the server runs without priority scheduling."""
    if not priority:
        return reqs
    return [state.validate(client, msgspec.structs.replace(r, priority=priority)) for r in reqs]


def constrain(tokenizer: Tokenizer, opening: str, params: SamplingParams, constraint: OutputConstraint | None,
              reasoning: str | None) -> tuple[SamplingParams, str | None, bool]:
    """(params, reasoning parser, whether the prompt closed the reasoning) of a request with its grammar (if
    any) under a reasoning parser (if any). The grammar waits for </think> (tool_choice required / named
    too, as in vLLM), or applies from the first token where the turn's opening (turn_opening) already closed
    the reasoning; without a grammar, a prompt that closed it (enable_thinking false) makes all the answer."""
    if constraint is not None:
        params = constraint.apply(params)
    if reasoning is None:
        return params, None, False
    gate = grammar_gate(tokenizer, opening, reasoning_tags(reasoning))  # Magistral's: [THINK] / [/THINK]
    if constraint is None:
        return params, reasoning, gate is not None and gate.reasoning_done
    if gate is None:
        # </think> is not one token here, so the grammar cannot wait for it: it constrains from the first
        # token, and a JSON answer has no <think> part to take out.
        return params, (None if constraint.kind == "json_schema" else reasoning), False
    if gate.after_token is not None:
        params = msgspec.structs.replace(params, grammar_after_token=gate.after_token)
    return params, reasoning, gate.reasoning_done


class _ChatResponder(OpenAIResponder):
    chunk_type = ChatCompletionChunk

    def __init__(self, gen: Generation, model: str, n: int, want_lp: bool, tools: ToolRequest | None = None,
                 reasoning: str | None = None, reasoning_done: bool = False, prompt_lp: int | None = None):
        """reasoning_done: the prompt closed the reasoning, so the whole output is content."""
        super().__init__(gen, model, n, prompt_lp)
        self.want_lp = want_lp
        self.tools, self.reasoning, self.reasoning_done = tools, reasoning, reasoning_done
        # Parsing the text into reasoning / content / tool calls: only when asked, else the text is content.
        self.parsing = reasoning is not None or (tools is not None and tools.mode != "none")
        self.outputs = [self._output() for _ in self.choices] if self.parsing else []
        self.token_ids, self.as_ids = bool(gen.body.return_token_ids), bool(gen.body.return_tokens_as_token_ids)

    def _ids(self, ids: list[int]) -> list[int] | UnsetType:
        """vLLM's token_ids of a choice or a chunk, when asked (return_token_ids)."""
        return list(ids) if self.token_ids else UNSET

    def _chunk(self, c: ChoiceState, first: bool, choice: ChatStreamChoice) -> ChatCompletionChunk:
        chunk = self.chunk([choice], self.chunk_usage())
        if first:  # return_token_ids: the prompt's ids go with each choice's first chunk, as vLLM's do
            chunk.prompt_token_ids = self._ids(c.req.input_ids)
        return chunk

    def _output(self) -> ChatOutput:
        parser = None
        if self.reasoning:
            parser = AnswerOnlyParser() if self.reasoning_done else create_reasoning_parser(self.reasoning)
        return ChatOutput(parser, self.tools.parser() if self.tools is not None else None)

    def _finish_reason(self, c: ChoiceState, output: ChatOutput | None) -> str | None:
        # OpenAI's and vLLM's: "tool_calls" where the model chose to call ("auto", "required"); a call the
        # request named was not the model's choice, so it ends "stop" (stream and not alike).
        named = self.tools is not None and self.tools.mode == "named"
        if output is not None and output.parsed.calls and c.finish_reason == "stop" and not named:
            return "tool_calls"
        return c.finish_reason

    def _message(self, c: ChoiceState) -> tuple[ChatResponseMessage, ChatOutput | None]:
        if not self.parsing:
            return ChatResponseMessage(content=c.text), None
        output = self._output()
        output.update(c.text, final=True)
        calls = output.tool_calls()
        msg = ChatResponseMessage(content=output.content or (None if calls else ""), tool_calls=calls or UNSET,
                                  reasoning_content=output.reasoning if self.reasoning else UNSET)
        return msg, output

    def body(self) -> ChatCompletionResponse:
        out = []
        for c in self.choices:
            lp = chat_logprobs(self.tokenizer, c.ids, c.logprobs, c.top_logprobs, self.as_ids) if self.want_lp else None
            msg, output = self._message(c)
            out.append(ChatCompletionChoice(index=c.index, message=msg, logprobs=lp,
                                            finish_reason=self._finish_reason(c, output),
                                            matched_stop=c.matched_stop, token_ids=self._ids(c.ids)))
        return ChatCompletionResponse(id=self.base, created=int(time.time()), model=self.model, choices=out,
                                      usage=self.usage(), system_fingerprint=self.fingerprint,
                                      prompt_logprobs=self.prompt_logprobs(self.choices[0]),
                                      prompt_token_ids=self._ids(self.choices[0].req.input_ids))

    def events(self, c: ChoiceState, out: RequestOutput, text: str) -> list[ChatCompletionChunk]:
        # The role goes with the first delta, which comes after prefill with the first token: a client
        # timing the first chunk measures the real time to first token.
        first = self.first_delta(c)
        lp = None
        if self.want_lp and out.new_token_ids:
            lp = chat_logprobs(self.tokenizer, out.new_token_ids, out.new_logprobs or [], out.new_top_logprobs,
                               self.as_ids)
        # return_token_ids: a delta's ids get a chunk even where their text is held back (a partial
        # character, a stop string's prefix), so a stream's token_ids join into the whole output's.
        ids = out.new_token_ids if self.token_ids else []
        if self.parsing:
            return self._parsed_events(c, first, lp, ids)
        # The text before a stop string is final: its chunk carries the finish_reason. Other ends keep
        # OpenAI's separate empty-delta finish chunk.
        stop_end = c.done and c.detok.stopped
        events = []
        if first or text or lp is not None or ids:
            events.append(self._chunk(c, first, ChatStreamChoice(
                index=c.index, delta=DeltaMessage(role="assistant" if first else UNSET, content=text), logprobs=lp,
                finish_reason=c.finish_reason if stop_end else None,
                matched_stop=c.matched_stop if stop_end else None, token_ids=self._ids(ids))))
            if stop_end:
                return events
        if c.done:
            events.append(self._chunk(c, False, ChatStreamChoice(
                index=c.index, delta=DeltaMessage(), finish_reason=c.finish_reason, matched_stop=c.matched_stop,
                token_ids=self._ids([]))))
        return events

    def _parsed_events(self, c: ChoiceState, first: bool, lp: ChatChoiceLogprobs | None,
                       ids: list[int]) -> list[ChatCompletionChunk]:
        """Reasoning, content and tool-call deltas of the choice's text so far, then the finish chunk."""
        output = self.outputs[c.index]
        d = output.update(c.text, final=c.done)
        events = []
        if first or d.reasoning or d.content or d.tool_calls or lp is not None or ids:
            quiet = not (d.reasoning or d.tool_calls)
            delta = DeltaMessage(role="assistant" if first else UNSET,
                                 content=d.content if d.content or (first and quiet) else UNSET,
                                 reasoning_content=d.reasoning or UNSET, tool_calls=d.tool_calls or UNSET)
            events.append(self._chunk(c, first, ChatStreamChoice(index=c.index, delta=delta, logprobs=lp,
                                                                 token_ids=self._ids(ids))))
        if c.done:
            events.append(self._chunk(c, False, ChatStreamChoice(
                index=c.index, delta=DeltaMessage(), finish_reason=self._finish_reason(c, output),
                matched_stop=c.matched_stop, token_ids=self._ids([]))))
        return events
