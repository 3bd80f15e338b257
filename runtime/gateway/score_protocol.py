"""The bodies and answers of POST /score (vLLM's ScoreRequest / ScoreResponse) and /rerank (vLLM's
Jina / Cohere-compatible RerankRequest / RerankResponse, which also takes SGLang's /v1/rerank fields)."""

from __future__ import annotations

from typing import Any

from msgspec import Struct

from runtime.gateway.embeddings_protocol import ClassificationUsage


class ScoreRequest(Struct, kw_only=True):
    model: str | None = None
    text_1: Any = None  # a string or strings: paired 1:1, 1:N or N:N with text_2
    text_2: Any = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None  # False: the raw logit (None: the server's --pooler-config)
    activation: bool | None = None  # vLLM's older name of use_activation
    # vLLM's (its score requests'): cached prefix KV shared only between requests of one salt, as on
    # /v1/embeddings; a reranker pooling the last token keeps a prefix cache, and a shared query prefix
    # would tell one tenant (by its timing) what another scored.
    cache_salt: str | None = None
    user: str | None = None


class ScoreData(Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: ClassificationUsage
    object: str = "list"


class RerankRequest(Struct, kw_only=True):
    model: str | None = None
    query: Any = None  # one string
    documents: Any = None  # strings, each scored against query
    top_n: int | None = None  # the best top_n results (None or 0: all)
    return_documents: bool = True  # Cohere's / SGLang's: False leaves each result's document out
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    activation: bool | None = None
    cache_salt: str | None = None  # as ScoreRequest's
    user: str | None = None


class RerankDocument(Struct):
    text: str


class RerankResult(Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
