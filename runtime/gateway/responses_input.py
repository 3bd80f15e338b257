"""What a /v1/responses body asks for, checked and turned into what the chat machinery takes: the input
items (and instructions) as chat messages for the model's chat template, function tools and tool_choice
as a ToolRequest, text.format as an OutputConstraint, and a 400 naming the field for whatever Shoal cannot
honour — anything that needs a stored response or conversation (Shoal keeps no state), built-in tools,
background runs, chat's fields that a Response names otherwise (max_tokens, logprobs, n, functions,
messages, ...), vLLM's Responses extras for features Shoal lacks (vllm_xargs, kv_transfer_params, ...).
reasoning.effort / summary are accepted and ignored (ignored_reasoning). A last assistant message cut short
(status in_progress / incomplete) is continued, as vLLM continues it (continues_final_message)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from runtime.gateway.errors import ApiError, bad_request, not_supported
from runtime.gateway.output_constraint import JSON_OBJECT_SCHEMA, OutputConstraint
from runtime.gateway.protocol import ChatMessage, OpenAISamplingFields
from runtime.gateway.responses_protocol import ResponsesRequest, ResponsesTextConfig
from runtime.gateway.tool_request import ToolRequest

_MESSAGE_ROLES = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What include can ask for here: logprobs, and reasoning.encrypted_content, which asks for nothing (reasoning
# items already carry their text in plain).
_INCLUDES_OK = frozenset({"reasoning.encrypted_content", LOGPROBS_INCLUDE})
# OpenAI's values of reasoning.effort and reasoning.summary (openai.types.shared.Reasoning)
_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
_SUMMARIES = frozenset({"auto", "concise", "detailed"})
# An output item's status (OpenAI's); a last item still partial is continued, as vLLM continues it.
_STATUSES = frozenset({"in_progress", "completed", "incomplete"})
_PARTIAL = frozenset({"in_progress", "incomplete"})
_PARTIAL_LAST = "a last input item that is an assistant message of status in_progress or incomplete"


def _given(value: Any) -> bool:
    return value is not None


def _true(value: Any) -> bool:
    return bool(value)


def _not_one(value: Any) -> bool:
    return value not in (None, 1)


# Fields of chat / completions (and vLLM's Responses extras for what Shoal lacks) that a Response cannot
# honour: (field, whether its value asks for something, why). Dropping one would answer another question
# than the client asked (a different length, no logprobs, one answer for n), so each is a 400 naming it.
_REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("prompt_logprobs", _given, "prompt_logprobs has no place in a Response: ask /v1/chat/completions or "
                                "/v1/completions for them"),
    ("response_format", _given, "response_format is chat's: a Response takes text.format"),
    ("max_tokens", _given, "max_tokens is chat's: a Response takes max_output_tokens"),
    ("max_completion_tokens", _given, "max_completion_tokens is chat's: a Response takes max_output_tokens"),
    # 0 is refused too: on chat it asks for logprobs (with no alternatives)
    ("logprobs", lambda v: v is not None and v is not False,
     f"logprobs is chat's: a Response takes include [{LOGPROBS_INCLUDE!r}] (and top_logprobs)"),
    ("n", _not_one, "a Response is one answer: n other than 1 has no place in it (send n requests)"),
    ("best_of", _not_one, "a Response is one answer: best_of other than 1 has no place in it"),
    ("echo", _true, "echo has no place in a Response: ask /v1/completions to echo a prompt"),
    ("return_token_ids", _true, "return_token_ids has no place in a Response: ask /v1/chat/completions"),
    ("return_tokens_as_token_ids", _true, "return_tokens_as_token_ids has no place in a Response: ask "
                                          "/v1/chat/completions"),
    ("add_generation_prompt", lambda v: v is False,
     f"a Response opens the assistant's turn, or continues {_PARTIAL_LAST}: add_generation_prompt false is chat's"),
    ("continue_final_message", _true,
     f"a Response continues {_PARTIAL_LAST}, and only that: continue_final_message is chat's"),
    ("prompt_embeds", _given, "prompt_embeds is not supported by this server yet"),
    ("chat_template", _given, "a per-request chat_template is not supported by this server yet (the server's "
                              "template renders every prompt)"),
    ("vllm_xargs", _true, "vllm_xargs (arguments of server-side extensions) is not supported by this server yet"),
    ("kv_transfer_params", _given, "kv_transfer_params (disaggregated prefill) is not supported by this server yet"),
    ("previous_input_messages", _given, "previous_input_messages (harmony messages) is not supported by this "
                                        "server yet: send the conversation as input items"),
    ("enable_response_messages", _true, "enable_response_messages (the rendered messages in the answer) is not "
                                        "supported by this server yet"),
    ("functions", _true, "functions is chat's legacy function calling: a Response takes tools "
                         '([{"type": "function", "name": ..., "parameters": ...}])'),
    ("function_call", lambda v: v is not None and v != "none",
     "function_call is chat's legacy function calling: a Response takes tool_choice"),
    ("modalities", lambda v: v is not None and bool(set(v) - {"text"}),
     "a Response answers in text only: modalities other than ['text'] (audio output) are not supported"),
    ("audio", _given, "audio output is not supported: a Response answers in text only"),
    ("messages", _given, "messages is chat's: a Response takes input (a string or a list of input items)"),
)


def check_unsupported(body: ResponsesRequest) -> None:
    stateless = "Shoal keeps no state: send the whole conversation in input"
    if body.previous_response_id is not None:
        raise not_supported(f"previous_response_id ({stateless})", "previous_response_id")
    if body.conversation is not None:
        raise not_supported(f"conversation ({stateless})", "conversation")
    if body.prompt is not None:
        raise not_supported("prompt (a stored prompt template)", "prompt")
    if body.background:
        raise not_supported("background (Shoal keeps no state to poll)", "background")
    for entry in body.include or ():
        if entry not in _INCLUDES_OK:
            raise not_supported(f"include {entry!r}", "include")
    for name, asks, why in _REFUSED:
        if asks(getattr(body, name)):
            raise bad_request(why, param=name, code="unsupported")
    if body.max_tool_calls is not None:
        raise not_supported("max_tool_calls", "max_tool_calls")
    if body.truncation not in (None, "disabled"):
        raise not_supported(f"truncation {body.truncation!r} (only 'disabled')", "truncation")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise not_supported(f"text.verbosity {body.text.verbosity!r}", "text.verbosity")


def ignored_reasoning(body: ResponsesRequest) -> list[str]:
    """The reasoning settings given (reasoning.effort, ...), which Shoal accepts and ignores: no model it
    serves takes an effort, and it writes no summaries. A value outside OpenAI's set is a 400 naming it."""
    given = []
    for name, allowed in (("effort", _EFFORTS), ("summary", _SUMMARIES), ("generate_summary", _SUMMARIES)):
        value = getattr(body.reasoning, name) if body.reasoning is not None else None
        if value is None:
            continue
        if value not in allowed:
            raise bad_request(f"reasoning.{name} must be one of {', '.join(sorted(allowed))}, got {value!r}",
                              param=f"reasoning.{name}")
        given.append(f"reasoning.{name}")
    return given


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the output_text gets logprobs: include asks for them; top_logprobs (0-20, checked with the
    sampling params) only says how many alternatives each token lists, so alone it is a 400 (OpenAI
    would answer an empty list, which looks like an answer)."""
    want = LOGPROBS_INCLUDE in (body.include or ())
    if (body.top_logprobs or 0) > 0 and not want:
        raise bad_request(f"top_logprobs needs include [{LOGPROBS_INCLUDE!r}]: without it no logprobs are "
                          f"returned", param="top_logprobs")
    return want


def input_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """instructions (a system message first), then the input: a string is one user message; items are
    messages, function calls (joined to the assistant turn before them, as one chat message holds its
    tool_calls) and function call outputs (tool messages). Reasoning items are dropped: chat templates
    drop a finished turn's reasoning too."""
    out: list[ChatMessage] = []
    if body.instructions:
        out.append(ChatMessage(role="system", content=body.instructions))
    items = body.input
    if items is None:
        raise bad_request("input is required: a string or a list of input items", param="input")
    if isinstance(items, str):
        return [*out, ChatMessage(role="user", content=items)]
    if not items:
        raise bad_request("input must hold at least one item", param="input")
    for k, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise bad_request(f"input[{k}]: role must be user, system, developer or assistant, got {role!r}",
                                  param="input")
            out.append(ChatMessage(role=role, content=_text(k, item.get("content"), "content")))
        elif kind == "function_call":
            arguments = _string(k, item, "arguments")
            try:  # checked here: the chat helper would name a chat message, not this item
                json.loads(arguments or "{}")
            except ValueError:
                raise bad_request(f"input[{k}].arguments is not valid JSON", param="input") from None
            call = {"id": _string(k, item, "call_id"), "type": "function",
                    "function": {"name": _string(k, item, "name"), "arguments": arguments}}
            prev = out[-1] if out else None
            if prev is not None and prev.role == "assistant":
                prev.tool_calls = [*(prev.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            out.append(ChatMessage(role="tool", content=_text(k, item.get("output"), "output"),
                                   tool_call_id=_string(k, item, "call_id")))
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise not_supported(f"input[{k}]: item_reference (Shoal keeps no state)", "input")
        else:
            raise not_supported(f"input[{k}]: items of type {kind!r} (only message, function_call, "
                                f"function_call_output and reasoning)", "input")
    return out


def continues_final_message(body: ResponsesRequest) -> bool:
    """Whether the prompt continues the last input item instead of opening a new assistant turn (vLLM's
    should_continue_final_message): it is an assistant message whose status says it was cut short
    (in_progress or incomplete: a Response that ran out of max_output_tokens, sent back for more). vLLM
    continues a partial reasoning item too, but Shoal drops reasoning items from the prompt (chat templates
    drop a finished turn's reasoning), so one last is a 400 rather than a new turn the client did not ask."""
    items = body.input
    if not isinstance(items, list) or not items:
        return False
    k, last = len(items) - 1, items[-1]
    status = last.get("status")
    if status is not None and status not in _STATUSES:
        raise bad_request(f"input[{k}].status must be one of {', '.join(sorted(_STATUSES))}, got {status!r}",
                          param="input")
    if status not in _PARTIAL:
        return False
    kind = last.get("type", "message")
    if kind == "reasoning":
        raise not_supported(f"input[{k}]: continuing a reasoning item of status {status!r} (only an assistant "
                            f"message is continued)", "input")
    return kind == "message" and last.get("role") == "assistant"


def _string(k: int, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"input[{k}].{key} must be a string", param="input")
    return value


def _text(k: int, content: Any, key: str) -> str:
    """A message's content or a call output: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{k}].{key} must be a string or a list of text parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise not_supported(f"input[{k}].{key}: a part of type {kind!r} (only input_text or output_text "
                                f"with a string text)", "input")
        texts.append(part["text"])
    return "".join(texts)


def tool_request(body: ResponsesRequest, parser_name: str | None) -> ToolRequest | None:
    """Responses' flat function tools ({type, name, parameters}) and tool_choice ({type: function, name})
    in chat's shape, checked by ToolRequest; its 400s are re-worded for the flat shape."""
    tools = []
    for k, tool in enumerate(body.tools or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise not_supported(f"tools[{k}]: tools of type {kind!r} (only function tools; built-in tools run "
                                f"on OpenAI's side)", f"tools[{k}]")
        fn = {key: tool[key] for key in ("name", "description") if key in tool}
        if tool.get("parameters") is not None:  # OpenAI allows null: no parameters
            fn["parameters"] = tool["parameters"]
        tools.append({"type": "function", "function": fn})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise not_supported(f"tool_choice of type {choice.get('type')!r} (only none, auto, required or "
                                f'{{"type": "function", "name": ...}})', "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice == "auto" and not tools:
        choice = None  # "auto" over no tools asks for nothing
    try:
        return ToolRequest.from_body(tools or None, choice, body.parallel_tool_calls, parser_name)
    except ApiError as e:
        e.message = e.message.replace(".function.", ".").replace(
            '{"type": "function", "function": {"name": ...}}', '{"type": "function", "name": ...}')
        e.param = e.param.replace(".function", "") if e.param else e.param
        e.args = (e.message,)
        raise


def output_constraint(text_format: OutputConstraint | None, fields: OpenAISamplingFields) -> OutputConstraint | None:
    """text.format's constraint or one of chat's structured-output fields (regex, ebnf, SGLang's json_schema,
    guided_*, structured_outputs): at most one of them all, as on chat (a 400 naming the second)."""
    found = [c for c in (text_format, OutputConstraint.from_body(fields)) if c is not None]
    if len(found) > 1:
        raise bad_request(f"give at most one structured-output constraint (text.format, regex, ebnf, json_schema, "
                          f"guided_json, guided_regex, guided_choice, guided_grammar, structured_outputs); got "
                          f"{found[0].param} and {found[1].param}", param=found[1].param)
    return found[0] if found else None


def format_constraint(text: ResponsesTextConfig | None) -> OutputConstraint | None:
    """text.format: text (none), json_object, or json_schema ({type, name, schema, strict}, flat)."""
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint("json_schema", JSON_OBJECT_SCHEMA, "text.format")
    if kind != "json_schema":
        raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                          param="text.format.type")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("text.format json_schema needs a schema object", param="text.format.schema")
    return OutputConstraint("json_schema", json.dumps(schema), "text.format.schema")
