"""POST /score and /v1/score (vLLM's: `text_1`, `text_2`, strings paired 1:1, 1:N or N:N, answered
{"data": [{"index", "object": "score", "score"}], "usage"}) and /rerank, /v1/rerank, /v2/rerank (vLLM's Jina /
Cohere-compatible form: `query`, `documents`, `top_n`, answered {"results": [{"index", "document": {"text"},
"relevance_score"}], "usage"} best first; SGLang's /v1/rerank fields (`return_documents`, `top_n`) are taken
too, but its bare-list answer is not: every path answers vLLM's shape). Each pair is the tokenizer's text-pair
encoding scored by a 1-label classifier's head (text/engine_scores.py): sigmoid of the logit, or raw with
use_activation false. Admitted, tracked and counted as /v1/embeddings is, cache_salt keeping cached prefixes
within one salt as there. A 400 naming `model` on a generation server, or one whose classifier has several
labels.

A hostile body must not stall the event loop every stream shares, so before any pair is encoded: the pair
count is held to what the server could ever run at once (--max-waiting-requests, --max-concurrent-requests:
/v1/embeddings' cap, which run_admitted would meet only after encoding; vLLM's score sets none), each text
certainly past the context is a 400 context_length_exceeded naming it (query, documents[i], text_1[i], ...),
and a large body is encoded on the tokenizer's worker thread."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from runtime.engine_client import EngineClient
from runtime.gateway.body import read_body
from runtime.gateway.embeddings_protocol import ClassificationUsage
from runtime.gateway.errors import bad_request
from runtime.gateway.openai_embeddings import check_batch_size, embedding_requests, run_admitted
from runtime.gateway.prompt_input import check_reach, off_loop, text_size
from runtime.gateway.protocol import encode
from runtime.gateway.score_protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from runtime.gateway.state import STATE_KEY, GatewayState
from runtime.text.engine_scores import pair_ids, pair_up, relevance, require_scorer


async def score(request: web.Request) -> web.Response:
    arrival = time.monotonic()
    body = await read_body(request, ScoreRequest)
    state = request.app[STATE_KEY]
    client = state.client()
    model = state.check_model(client, body.model)
    require_scorer(client.pooling)
    for name, value in (("text_1", body.text_1), ("text_2", body.text_2)):
        if value is None:
            raise bad_request(f"{name} is required", param=name)
    base = state.new_id("score")
    pairs = pair_up(body.text_1, body.text_2)
    # pair_up pairs 1:N or N:N, never N:1, so text_2 sets the count
    _check_pairs(state, client, pairs, "text_2", (("text_1", body.text_1), ("text_2", body.text_2)), body)
    scores, tokens = await _scores(request, state, client, base, pairs, body, arrival, "text_1")
    out = ScoreResponse(id=base, created=int(time.time()), model=model,
                        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                        usage=ClassificationUsage(prompt_tokens=tokens, total_tokens=tokens))
    return web.Response(body=encode(out), content_type="application/json")


async def rerank(request: web.Request) -> web.Response:
    arrival = time.monotonic()
    body = await read_body(request, RerankRequest)
    state = request.app[STATE_KEY]
    client = state.client()
    model = state.check_model(client, body.model)
    require_scorer(client.pooling)
    if not isinstance(body.query, str):
        raise bad_request("query must be a string", param="query")
    docs = body.documents
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise bad_request("documents must be a non-empty list of strings", param="documents")
    if body.top_n is not None and body.top_n < 0:
        raise bad_request(f"top_n must be >= 0 (0: every document), got {body.top_n}", param="top_n")
    base = state.new_id("rerank")
    pairs = pair_up(body.query, docs, ("query", "documents"))
    _check_pairs(state, client, pairs, "documents", (("query", body.query), ("documents", docs)), body)
    scores, tokens = await _scores(request, state, client, base, pairs, body, arrival, "documents")
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:body.top_n or len(docs)]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(docs[i]) if body.return_documents else None) for i in order]
    out = RerankResponse(id=base, model=model, usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
                         results=results)
    return web.Response(body=encode(out), content_type="application/json")


def _check_pairs(state: GatewayState, client: EngineClient, pairs: list[tuple[str, str]], counted: str,
                 fields: tuple[tuple[str, Any], ...], body: ScoreRequest | RerankRequest) -> None:
    """400s before any pair is encoded: more pairs than the server could ever run at once (counted: the field
    whose list sets their number), or a text certainly past the context (fields: each (name, string or list
    of strings) as sent; an item is named name[i]). With truncate_prompt_tokens any length is kept (cut after
    encoding), as on the prompt routes."""
    check_batch_size(state, len(pairs), counted, f"pairs to score ({counted})")
    if body.truncate_prompt_tokens is not None:
        return
    tok = client.tokenizer
    for name, value in fields:
        for i, text in enumerate([value] if isinstance(value, str) else value):
            check_reach(tok, text, client.context_len, name if isinstance(value, str) else f"{name}[{i}]")


async def _scores(request: web.Request, state: GatewayState, client: EngineClient, base: str,
                  pairs: list[tuple[str, str]], body: ScoreRequest | RerankRequest, arrival: float,
                  param: str) -> tuple[list[float], int]:
    """Each pair's score, in order, and the prompt tokens they took."""
    if body.use_activation is not None and body.activation is not None and body.use_activation != body.activation:
        raise bad_request("use_activation and activation (its older name) disagree", param="use_activation")
    pooling = require_scorer(client.pooling)
    activate = next((v for v in (body.use_activation, body.activation) if v is not None), pooling.use_activation)
    tok, keep = client.tokenizer, body.truncate_prompt_tokens
    # A truncating encode always runs on a worker lane (grows): it may set truncation on the tokenizer's
    # truncating copy (Tokenizer.truncating, held by one thread at a time), never on the one the loop uses
    def encode() -> list[list[int]]:
        return pair_ids(tok, pairs, keep, client.context_len, param)

    # Sized by the distinct texts: pair_ids encodes each once (a query shared by every pair counts once)
    ids = await off_loop(request, tok, text_size({t for pair in pairs for t in pair}), encode, grows=keep is not None)
    reqs = embedding_requests(client, [f"{base}-{i}" for i in range(len(ids))], ids, param,
                              cache_salt=body.cache_salt)
    all_logits = await run_admitted(state, client, base, reqs, arrival, param)
    return [relevance(pooling, logits, activate) for logits in all_logits], sum(len(r.input_ids) for r in reqs)
