"""The HTTP bodies the gateway reads and writes, as msgspec Structs: OpenAI completions, chat completions
and models, SGLang-style /generate, and the error body. Requests accept fields they do not declare, at
any depth, as vLLM and SGLang do: the official clients send newer OpenAI fields (store, metadata,
stream_options.include_obfuscation, ...) that change nothing here. body.read_body logs and counts them
(IgnoredFields). A declared field whose value Shoal cannot honour is a 400 that says so. Numeric knobs
accept null (some clients send it) and mean "the default" then. Every integer is bounded to int64 at
decoding (Int64), so an absurd value is a 400 naming its field before it can reach a tensor."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

# What the engine's int64 tensors can hold; narrower semantic ranges are SamplingParams.validate's.
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]

# ---- shared --------------------------------------------------------------------------------------


class StreamOptions(Struct):
    include_usage: bool = True  # vLLM's default: a stream_options object, even {}, asks for the usage chunk
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the running usage

    def usage_modes(self) -> tuple[bool, bool]:
        """(a final usage chunk, usage in every chunk)."""
        return self.include_usage, self.include_usage and self.continuous_usage_stats


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class UsageInfo(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorInfo


class ModelCard(Struct):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "shoal"
    root: str | None = None
    max_model_len: int | None = None
    # an adapter's base model (vLLM's); UNSET, so the base model's own card stays without the key
    parent: str | UnsetType = UNSET


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class StructuredOutputs(Struct, kw_only=True):
    """vLLM's structured_outputs object; one of its constraint keys at most. Its tuning keys
    (disable_any_whitespace, whitespace_pattern, ...) change nothing here and are ignored like any
    undeclared key."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None  # not supported: a 400


class NamedRequest(Struct, kw_only=True):
    """vLLM's request_id, on every body a response id comes from (chat, completions, /v1/responses, embeddings,
    /pooling, /classify): the response is named by it as by X-Request-Id, which goes first (request_ids.py)."""

    request_id: str | None = None  # null: none sent (a random id); "" or a non-string: a 400 naming it


class OpenAISamplingFields(NamedRequest, kw_only=True):
    """The fields /v1/completions and /v1/chat/completions share (GatewayState.sampling_params reads them)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    n: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    min_tokens: Int64 | None = None
    skip_special_tokens: bool | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Structured output: OpenAI's response_format, SGLang/vLLM's regex and ebnf, vLLM's guided_* and newer
    # structured_outputs (at most one of them all: OutputConstraint.from_body).
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    include_stop_str_in_output: bool | None = None  # vLLM's: the matched stop string stays in the text
    truncate_prompt_tokens: Int64 | None = None  # vLLM's: keep the prompt's last k tokens (-1: the context)
    allowed_token_ids: list[Int64] | None = None  # vLLM's: sampling restricted to these ids
    bad_words: list[str] | None = None  # vLLM's: these words are never generated
    priority: Int64 | None = None  # vLLM's and SGLang's: with --enable-priority-scheduling (else only 0)
    cache_salt: str | None = None  # vLLM's and SGLang's: cached prefix KV shared only between requests of one salt
    # vLLM's: each prompt position's logprobs (the prompt token and the top N), on the response
    prompt_logprobs: Int64 | None = None
    json_schema: dict[str, Any] | str | None = None  # SGLang's: a JSON Schema (JSON text), one more constraint
    no_stop_trim: bool | None = None  # SGLang's spelling of include_stop_str_in_output
    lora_path: str | None = None  # SGLang's: an adapter's name (or its --lora-modules folder), as on /generate
    # vLLM's: the response carries token ids (prompt_token_ids, each choice's token_ids); logprobs name
    # tokens as "token_id:N" (a token's text may not say which token it was)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # Fields that would change the answer in ways Shoal cannot honour: a value that asks is a 400
    # (extension_fields.check_unhonoured).
    use_beam_search: bool | None = None
    length_penalty: float | None = None  # beam search's: only 1 (none) is accepted
    logits_processors: list[Any] | None = None  # vLLM's: qualified names of server-side code
    custom_logit_processor: str | None = None  # SGLang's: serialized server-side code
    structural_tag: str | dict[str, Any] | None = None
    stop_regex: str | list[str] | None = None  # SGLang's


# ---- /v1/completions -----------------------------------------------------------------------------


class CompletionRequest(OpenAISamplingFields, kw_only=True):
    prompt: str | list[Any]  # str | list[str] | list[int] | list[list[int]], checked by the handler
    max_tokens: Int64 | None = 16  # OpenAI's default; an explicit null means "as many as the context allows"
    best_of: Int64 | None = None
    logprobs: Int64 | None = None
    echo: bool | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's special tokens (BOS)
    prompt_embeds: Any = None  # vLLM's (behind --enable-prompt-embeds): a 400


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Struct):
    """One token of a prompt position, in vLLM's prompt_logprobs (its Logprob)."""

    logprob: float
    rank: int | None  # in the position's whole distribution, 1 = the most likely
    decoded_token: str | None


# vLLM's prompt_logprobs: per prompt position, null for the first, else its tokens keyed by token id (a JSON
# object key, so a string): the prompt's own token first, then the top N.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_logprobs: PromptLogprobs | None | UnsetType = UNSET  # only when asked (never in a stream)
    # return_token_ids: the prompt's ids (a stream's first chunk of the choice), the output's (a chunk's own)
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


class CompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | UnsetType = UNSET  # streaming chunks carry it only with include_usage


# ---- /v1/chat/completions ------------------------------------------------------------------------


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None
    # an assistant turn's reasoning, for templates that replay it (vLLM's reasoning, SGLang's reasoning_content)
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(OpenAISamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None
    # Known OpenAI fields Shoal honours only in part: a value it cannot honour is a 400 that says so.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None  # only ["text"]
    audio: dict[str, Any] | None = None  # audio output parameters: never
    # vLLM / SGLang chat extensions: extra variables for the chat template (e.g. Qwen3's enable_thinking),
    # the assistant header at the end, or the last (assistant) message continued instead of closed.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens on top of the template's
    documents: list[dict[str, str]] | None = None  # vLLM's: RAG documents, for templates that take them
    chat_template: str | None = None  # vLLM's per-request template: a 400 (the server's template only)
    best_of: Int64 | None = None  # only n
    echo: bool | None = None  # vLLM's (the last message before the answer): a 400 when true


class ChatTopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatChoiceLogprobs(Struct):
    content: list[ChatTokenLogprob] | None


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class DeltaFunctionCall(Struct, omit_defaults=True):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class DeltaToolCall(Struct, omit_defaults=True):
    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: DeltaFunctionCall | UnsetType = UNSET


class ChatResponseMessage(Struct, kw_only=True):
    content: str | None
    role: str = "assistant"
    refusal: str | None = None  # OpenAI's shape: always present, null (Shoal never refuses by policy)
    tool_calls: list[ToolCall] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET  # with --reasoning-parser, as vLLM and SGLang


class ChatCompletionChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET  # return_token_ids


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None | UnsetType = UNSET  # only when asked: the prompt all choices share
    prompt_token_ids: list[int] | UnsetType = UNSET  # return_token_ids


class DeltaMessage(Struct, omit_defaults=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatStreamChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET  # return_token_ids: this chunk's


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET  # return_token_ids: with a choice's first chunk


# ---- native /generate (SGLang style) -------------------------------------------------------------


class GenerateBody(Struct, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # list[int] or list[list[int]], checked by the handler
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: Int64 = 0
    return_text_in_logprobs: bool = False
    rid: str | None = None
    lora_path: str | None = None  # SGLang's: an adapter's name (or its --lora-modules folder)
    lora_name: str | None = None
    priority: Int64 | None = None  # SGLang's: with --enable-priority-scheduling (else only 0)
    cache_salt: str | None = None  # SGLang's extra_key / vLLM's: cached prefix KV shared only within one salt
    logprob_start_len: Int64 = -1  # SGLang's: where in the prompt input_token_logprobs start (-1: its last token)
    custom_logit_processor: str | None = None  # SGLang's server-side code: a 400 (chat and completions refuse it too)


class GenerateFinishReason(Struct, omit_defaults=True):
    type: str
    matched: int | str | None = None
    message: str | None = None


class GenerateMetaInfo(Struct, kw_only=True):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: GenerateFinishReason | None
    e2e_latency: float
    # [logprob, token_id] or [logprob, token_id, text]; top: one list of those per output token
    output_token_logprobs: list[list[Any]] | UnsetType = UNSET
    output_top_logprobs: list[list[list[Any]]] | UnsetType = UNSET
    # SGLang's: from logprob_start_len to the prompt's end, the first logprob null; top: null where none
    input_token_logprobs: list[list[Any]] | UnsetType = UNSET
    input_top_logprobs: list[list[list[Any]] | None] | UnsetType = UNSET


class GenerateResponse(Struct, kw_only=True):
    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo


class AbortRequestBody(Struct):
    rid: str  # a response id (aborts all its choices) or one request's rid


def encode(obj: Any) -> bytes:
    return msgspec.json.encode(obj)
