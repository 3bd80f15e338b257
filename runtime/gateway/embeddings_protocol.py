"""The bodies of POST /v1/embeddings as msgspec Structs: OpenAI's request (input as a string, strings, token
ids or lists of token ids; encoding_format float or base64; Matryoshka `dimensions`; `user`), vLLM's
additions (truncate_prompt_tokens, add_special_tokens, normalize / use_activation, cache_salt, and `messages`
in place of `input`: one conversation rendered with the chat template), and OpenAI's response; SGLang's native POST /encode body
and answer; POST /classify's body (vLLM's, with SGLang's text / input_ids form) and vLLM's answer."""

from __future__ import annotations

from typing import Any

from msgspec import UNSET, Struct, UnsetType

from runtime.gateway.protocol import Int64, NamedRequest

ENCODING_FORMATS = ("float", "base64")


class PoolingBody(NamedRequest, kw_only=True):
    """What /v1/embeddings, /pooling and /classify read alike: the inputs and how they become tokens."""

    # str | list[str] | list[int] | list[list[int]]: one union msgspec cannot decode (several array
    # types), so it is checked by hand (openai_embeddings.embedding_inputs) with errors naming `input`.
    input: Any = UNSET
    messages: list[dict[str, Any]] | UnsetType = UNSET  # vLLM's chat form of the request
    model: str | None = None
    encoding_format: str | None = None  # None: float
    dimensions: Int64 | None = None
    user: str | None = None
    truncate_prompt_tokens: Int64 | None = None
    add_special_tokens: bool | None = None  # None: vLLM's defaults (True for input, False for messages)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    # vLLM's per-request L2 normalization (None: the model's pooler config); use_activation is its newer
    # name. /classify redeclares use_activation as its probs' activation and refuses normalize.
    normalize: bool | None = None
    use_activation: bool | None = None


class EmbeddingRequest(PoolingBody, kw_only=True):
    """POST /v1/embeddings and /pooling."""

    # vLLM's (its pooling requests'): cached prefix KV shared only between requests of one salt. An embedding
    # server with last-token pooling keeps a prefix cache (ServerArgs.prefix_cache_for), so a salt keeps
    # one tenant's cache hits (their timing) from telling another what it embedded.
    cache_salt: str | None = None


class EmbeddingData(Struct):
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32
    object: str = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
    object: str = "list"


class PoolingData(Struct):
    index: int
    data: list[float] | str  # vLLM's /pooling: the pooled output (str: base64 of little-endian float32)
    object: str = "pooling"


class PoolingResponse(Struct):
    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: EmbeddingUsage
    object: str = "list"


class EncodeRequest(Struct, kw_only=True):
    """SGLang's POST /encode (EmbeddingReqInput's text-model fields)."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # list[int] or list[list[int]], checked by the handler
    rid: str | list[str] | None = None  # a list: one per input of a batch (SGLang's); a string: the batch's base
    dimensions: Int64 | None = None
    cache_salt: str | None = None  # as on /v1/embeddings: cached prefixes shared only within one salt


class EncodeMetaInfo(Struct):
    id: str
    prompt_tokens: int
    e2e_latency: float


class EncodeResponse(Struct):
    embedding: list[float]
    meta_info: EncodeMetaInfo


class ClassifyRequest(EmbeddingRequest, kw_only=True):
    """POST /classify: vLLM's ClassificationRequest (`input` or `messages`, as /v1/embeddings takes them)
    or SGLang's (EmbeddingReqInput's `text` / `input_ids` / `rid`, answered as /encode answers)."""

    use_activation: bool | None = None  # vLLM's: False gives the raw logits as probs (None: the server's --pooler-config)
    activation: bool | None = None  # vLLM's older name of use_activation
    text: Any = None  # SGLang's form: answered in /encode's shape
    input_ids: Any = None
    rid: str | list[str] | None = None


class ClassificationData(Struct):
    index: int
    label: str  # id2label of the most probable class
    probs: list[float]
    num_classes: int


class ClassificationUsage(Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class ClassificationResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: ClassificationUsage
    object: str = "list"
