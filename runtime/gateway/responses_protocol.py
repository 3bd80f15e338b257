"""The bodies of POST /v1/responses (OpenAI's Responses API) as msgspec Structs: the request, the Response
object, its output items and the stream's events, in the shapes the openai SDK parses
(openai/types/responses). Input items stay plain dicts (openai_responses.py checks them): the API has
dozens of item types, and a Struct union would turn an unsupported one into a decode error instead of
a 400 that names it. As on the other routes, keys the request Struct does not declare are accepted and
ignored (body.read_body counts them); a declared field Shoal cannot honour is a 400."""

from __future__ import annotations

from typing import Any

from msgspec import Struct

from runtime.gateway.protocol import ChatTokenLogprob, ErrorInfo, Int64, NamedRequest, StructuredOutputs

# ---- the request ---------------------------------------------------------------------------------


class ResponsesTextConfig(Struct, kw_only=True):
    format: dict[str, Any] | None = None  # {type: text} | {type: json_object} | {type: json_schema, name, schema}
    verbosity: str | None = None  # only "medium" (the default): nothing here can shorten or lengthen answers


class ResponsesReasoning(Struct, kw_only=True):
    # Accepted and ignored (logged and counted, as vLLM accepts them): the models Shoal serves have no
    # effort knob, and Shoal writes no summaries (the reasoning item carries the whole text). A value
    # outside OpenAI's set is a 400 (responses_input.ignored_reasoning).
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(NamedRequest, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    text: ResponsesTextConfig | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Accepted and echoed; nothing is stored (store) or acted on (metadata, user, safety_identifier;
    # prompt_cache_key: the prefix cache finds a shared prefix by itself).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: str | None = None  # "disabled" only: a prompt past the context is a 400, never cut
    reasoning: ResponsesReasoning | None = None
    # Known fields that need state or features Shoal lacks: a value that asks for them is a 400.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None  # reasoning.encrypted_content (a no-op), message.output_text.logprobs
    max_tool_calls: Int64 | None = None
    top_logprobs: Int64 | None = None  # 0-20 alternatives per token, with include's logprobs
    # vLLM's extensions of the same route (sampling knobs and the chat template's variables).
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: Int64 | None = None
    skip_special_tokens: bool | None = None
    allowed_token_ids: list[Int64] | None = None  # sampling restricted to these ids
    bad_words: list[str] | None = None  # never generated (the gateway tokenizes them)
    priority: Int64 | None = None  # with --enable-priority-scheduling (else only 0)
    cache_salt: str | None = None  # vLLM's: cached prefix KV shared only between requests of one salt
    chat_template_kwargs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None  # token ids (as strings) to logit offsets
    include_stop_str_in_output: bool | None = None  # the matched stop string stays in the text
    truncate_prompt_tokens: Int64 | None = None  # keep the prompt's last k tokens (-1: the context)
    # Chat's structured-output fields: each one as on chat, and at most one constraint with text.format.
    regex: str | None = None
    ebnf: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    json_schema: dict[str, Any] | str | None = None  # SGLang's: a JSON Schema (JSON text), one more constraint
    # SGLang's spellings, as on chat (extension_fields.py): the adapter by name or --lora-modules folder
    # (agreeing with `model`), and include_stop_str_in_output's other name (agreeing with it).
    lora_path: str | None = None
    no_stop_trim: bool | None = None
    documents: list[dict[str, str]] | None = None  # vLLM's: RAG documents, for templates that take them
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens on top of the template's
    # What chat refuses, refused alike (extension_fields.check_unhonoured; a per-request chat_template).
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    logits_processors: list[Any] | None = None
    custom_logit_processor: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    stop_regex: str | list[str] | None = None
    chat_template: str | None = None
    # vLLM's Responses fields for what Shoal lacks (server-side extensions, disaggregated prefill, harmony
    # messages, the rendered messages in the answer): a value that asks is a 400 (responses_input.py).
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    previous_input_messages: list[Any] | None = None
    enable_response_messages: bool | None = None
    # Chat's and completions' fields that a Response names otherwise or has no place for: a value that
    # asks is a 400 saying so (OpenAI refuses them on this route too), never a silently different answer.
    prompt_logprobs: Int64 | None = None
    response_format: dict[str, Any] | None = None
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | Int64 | None = None
    n: Int64 | None = None
    best_of: Int64 | None = None
    echo: bool | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    prompt_embeds: Any = None
    # Chat's fields for what a Response asks otherwise or never: legacy function calling (tools /
    # tool_choice), audio output, and chat's conversation (input): a value that asks is a 400 too.
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    messages: Any = None


# ---- the Response object -------------------------------------------------------------------------


class OutputText(Struct, kw_only=True):
    text: str
    type: str = "output_text"
    annotations: list[Any] = []
    # OpenAI's shape is chat's: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}.
    logprobs: list[ChatTokenLogprob] = []


class ReasoningText(Struct, kw_only=True):
    text: str
    type: str = "reasoning_text"


class OutputMessage(Struct, kw_only=True):
    id: str
    content: list[OutputText]
    status: str
    type: str = "message"
    role: str = "assistant"


class FunctionCallItem(Struct, kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str
    type: str = "function_call"


class ReasoningItem(Struct, kw_only=True):
    id: str
    content: list[ReasoningText]
    status: str
    type: str = "reasoning"
    summary: list[Any] = []
    encrypted_content: str | None = None


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(Struct, kw_only=True):
    cached_tokens: int
    cache_write_tokens: int = 0  # the SDK's model has it; the prefix cache writes as it goes, unbilled


class OutputTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct, kw_only=True):
    reason: str


class ResponseObject(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str  # in_progress | completed | incomplete | failed
    output: list[Any]  # OutputItem Structs (a plain union of untagged Structs cannot be a msgspec type)
    usage: ResponseUsage | None = None
    object: str = "response"
    completed_at: int | None = None  # only on a completed one (the openai SDK's model says so)
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    # The request's settings, echoed as OpenAI does.
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = {}
    reasoning: dict[str, Any] | None = None
    truncation: str = "disabled"
    store: bool = False
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] = {}
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    service_tier: str = "default"


class ResponseError(Struct, kw_only=True):
    """A failed Response's error (OpenAI's codes: server_error for what failed in the engine)."""

    code: str
    message: str


# ---- stream events (each carries its type and a sequence_number counting from 0) ------------------


class ResponseEvent(Struct, kw_only=True):
    """response.created / in_progress / completed / incomplete / failed."""

    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(Struct, kw_only=True):
    """response.output_item.added / done."""

    type: str
    sequence_number: int
    output_index: int
    item: Any  # an OutputItem


class _ItemEvent(Struct, kw_only=True):
    """What every event about one output item carries (msgspec puts a base's fields first)."""

    sequence_number: int
    item_id: str
    output_index: int


class _PartEvent(_ItemEvent, kw_only=True):
    """An event about one content part of an item."""

    content_index: int


class ContentPartEvent(_PartEvent, kw_only=True):
    """response.content_part.added / done."""

    type: str
    part: OutputText | ReasoningText


class TextDeltaEvent(_PartEvent, kw_only=True):
    """response.output_text.delta."""

    delta: str
    logprobs: list[ChatTokenLogprob] = []
    type: str = "response.output_text.delta"


class TextDoneEvent(_PartEvent, kw_only=True):
    """response.output_text.done."""

    text: str
    logprobs: list[ChatTokenLogprob] = []
    type: str = "response.output_text.done"


class ReasoningDeltaEvent(_PartEvent, kw_only=True):
    """response.reasoning_text.delta."""

    delta: str
    type: str = "response.reasoning_text.delta"


class ReasoningDoneEvent(_PartEvent, kw_only=True):
    """response.reasoning_text.done."""

    text: str
    type: str = "response.reasoning_text.done"


class ArgumentsDeltaEvent(_ItemEvent, kw_only=True):
    """response.function_call_arguments.delta."""

    delta: str
    type: str = "response.function_call_arguments.delta"


class ArgumentsDoneEvent(_ItemEvent, kw_only=True):
    """response.function_call_arguments.done."""

    name: str
    arguments: str
    type: str = "response.function_call_arguments.done"


class ErrorEvent(Struct, kw_only=True):
    """error: a stream that failed after its 200 headers. OpenAI's fields, and the usual error object too,
    which the openai SDK raises as an APIError."""

    sequence_number: int
    code: str | None
    message: str
    param: str | None
    error: ErrorInfo
    type: str = "error"
