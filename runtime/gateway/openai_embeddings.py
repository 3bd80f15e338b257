"""POST /v1/embeddings on an embedding server (--is-embedding): OpenAI's embeddings API, as vLLM and
SGLang serve it. Each input (text, or token ids) becomes one embedding request, all submitted at once;
the answer lists the pooled vectors in input order, as floats or as base64 of little-endian float32
(the openai SDK asks for base64 by default), shortened to `dimensions` for a Matryoshka model, then
L2-normalized as vLLM's `normalize` (or `use_activation`) asks, the model's pooler config by default. Inputs are
embedded as sent: sentence-transformers' prompts (config_sentence_transformers.json, its default_prompt_name
too) are not put before them, as vLLM's server does not (Engine.encode applies them, as sentence-transformers).
On a generation server the route answers 400, as vLLM's does ("does not support the Embeddings API");
the generation routes on an embedding server likewise (runtime/gateway/app.py).

An embedding batch goes through the gateway's admission as a generation's choices do (run_admitted): each
input counts against --max-concurrent-requests (429), the queue estimate may refuse it (429 with
Retry-After), it is tracked (so /abort_request and the shutdown drain see it, which answers it 503), and
each input's end counts in the metrics as a finished request of n=1 that generated nothing (vLLM's series
of finished requests count pooling requests so: request_success by reason, request_prompt_tokens, params_n;
no max_tokens), beside end-to-end latency and queue time.

cache_salt (vLLM's) is honoured as on chat: an embedding server pooling the last token keeps a prefix cache
(a match never covers the last position, which every prefill computes), so its inputs share cached prefix KV
only with inputs of the same salt; under mean / CLS pooling there is no cache and the salt changes nothing."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
import time
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web
from msgspec import UNSET

from runtime.engine_client import EngineClient
from runtime.errors import InvalidRequestError
from runtime.gateway.body import read_body
from runtime.gateway.chat_render import ChatRender
from runtime.gateway.embeddings_protocol import (
    ENCODING_FORMATS,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    PoolingBody,
    PoolingData,
    PoolingResponse,
)
from runtime.gateway.errors import ApiError, bad_request
from runtime.gateway.health_probe import HEALTH_PROBE_KEY
from runtime.gateway.prompt_input import check_reach, off_loop, prompt_count, text_size
from runtime.gateway.protocol import encode
from runtime.gateway.state import STATE_KEY, GatewayState
from runtime.messages import GenerateRequest, RequestOutput
from runtime.stream_delivery import gather_or_cancel
from runtime.text.embedding_request import embedding_request, task_mismatch, truncate_tokens
from runtime.text.pooling_config import PoolingConfig

OutputHook = Callable[[GenerateRequest, RequestOutput], None]


async def embeddings(request: web.Request) -> web.Response:
    base, model, vectors, tokens = await _pooled(request, "embd")
    data = [EmbeddingData(index=i, embedding=v) for i, v in enumerate(vectors)]
    out = EmbeddingResponse(id=base, created=int(time.time()), model=model, data=data,
                            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return web.Response(body=encode(out), content_type="application/json")


async def pooling(request: web.Request) -> web.Response:
    """vLLM's POST /pooling: the same body and vectors as /v1/embeddings (a classifier's: its raw logits),
    answered as {"data": [{"index", "object": "pooling", "data"}]}."""
    base, model, vectors, tokens = await _pooled(request, "pool")
    data = [PoolingData(index=i, data=v) for i, v in enumerate(vectors)]
    out = PoolingResponse(id=base, created=int(time.time()), model=model, data=data,
                          usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return web.Response(body=encode(out), content_type="application/json")


async def _pooled(request: web.Request, prefix: str) -> tuple[str, str, list[list[float] | str], int]:
    """(request id, model name, each input's vector as encoding_format asks, prompt tokens)."""
    arrival = time.monotonic()
    body = await read_body(request, EmbeddingRequest)
    state = request.app[STATE_KEY]
    client = state.client()
    model = state.check_model(client, body.model)
    pooling = pooling_of(client)
    fmt = body.encoding_format or "float"
    if fmt not in ENCODING_FORMATS:
        raise bad_request(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, got {fmt!r}",
                          param="encoding_format")
    pooling.check_dimensions(body.dimensions)
    normalize = pooling.normalize_for(body.normalize, body.use_activation)
    ids = [truncate_tokens(x, body.truncate_prompt_tokens, client.context_len)
           for x in await token_inputs(state, client, body, request)]
    base = state.new_id(prefix, request_id=body.request_id)
    reqs = embedding_requests(client, [f"{base}-{i}" for i in range(len(ids))], ids, cache_salt=body.cache_salt)
    vectors = await run_admitted(state, client, base, reqs, arrival)
    return (base, model, [_encoded(pooling.shorten(v, body.dimensions, normalize), fmt) for v in vectors],
            sum(len(r.input_ids) for r in reqs))


async def health_embed(request: web.Request) -> web.Response:
    """/health_generate on an embedding server: ready and able to embed (one short input); the check is shared
    by concurrent callers and reused for a second, as /health_generate's (health_probe.py)."""
    state = request.app[STATE_KEY]
    client = state.client()
    error = await request.app[HEALTH_PROBE_KEY].result(lambda: _embed_check(state, client))
    if error is not None:
        raise ApiError(503, f"embedding check failed: {error}", code="engine_unhealthy")
    return web.Response(body=encode({"status": "ok"}), content_type="application/json")


async def _embed_check(state: GatewayState, client: EngineClient) -> str | None:
    """None once one short input was embedded, else why it was not."""
    try:
        ids = client.tokenizer.encode("ping") or [0]
        await asyncio.wait_for(run_embeddings(client, [client.validate(
            embedding_request(state.new_id("health"), ids, client.context_len))]), 20.0)
    except (asyncio.TimeoutError, ApiError, InvalidRequestError) as e:
        return getattr(e, "message", None) or type(e).__name__
    return None


def pooling_of(client: EngineClient) -> PoolingConfig:
    """The embedding server's pooling; a 400 naming the mismatch on a generation server."""
    if client.pooling is None:
        raise ApiError(400, task_mismatch(False), param="model", code="model_not_supported")
    return client.pooling


async def token_inputs(state: GatewayState, client: EngineClient, body: PoolingBody,
                       request: web.Request) -> list[list[int]]:
    """Each input's token ids: `input` as OpenAI defines it, or vLLM's `messages` (one conversation). Inputs
    are counted (check_batch_size) and texts bounded by the context before any is encoded, and a large body
    (or a chat whose template may write much more) is encoded off the loop (off_loop, ChatRender)."""
    has_input, has_messages = body.input is not UNSET, body.messages is not UNSET
    if has_input == has_messages:
        raise bad_request("give either input or messages", param="input")
    tok = client.tokenizer
    bound = None if body.truncate_prompt_tokens is not None else client.context_len
    if has_messages:
        if not body.messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                        for m in body.messages):
            raise bad_request("messages must be a non-empty list of {'role': ..., 'content': ...}", param="messages")
        if body.add_special_tokens:  # the chat template writes the special tokens itself
            raise bad_request("add_special_tokens applies to input; messages are rendered by the chat template",
                              param="add_special_tokens")
        chat = ChatRender(body.add_generation_prompt, None, body.continue_final_message, body.chat_template_kwargs,
                          context_len=bound)
        return [(await chat.ids(request, tok, lambda: body.messages))[0]]
    special = True if body.add_special_tokens is None else body.add_special_tokens
    x = body.input
    if isinstance(x, str):
        x = [x]
    elif not isinstance(x, list) or not x:
        raise bad_request("input must be a string, a list of strings, a list of token ids or a list of lists "
                          "of token ids, and not empty", param="input")
    check_batch_size(state, prompt_count(x), "input")
    if all(isinstance(t, str) for t in x):
        if bound is not None:
            for t in x:
                check_reach(tok, t, bound, "input")
        return await off_loop(request, tok, text_size(x),
                              lambda: [tok.encode(t, add_special_tokens=special) for t in x])
    if all(_is_id(t) for t in x):
        return [list(x)]
    if all(isinstance(row, list) and row and all(_is_id(t) for t in row) for row in x):
        return [list(row) for row in x]
    raise bad_request("input must be a string, a list of strings, a list of token ids or a list of non-empty "
                      "lists of token ids (not a mix)", param="input")


def embedding_requests(client: EngineClient, rids: list[str], ids: list[list[int]], param: str = "input",
                       cache_salt: str | None = None) -> list[GenerateRequest]:
    """One validated request per input (all checked before any is sent: a bad one leaves nothing running);
    param: the body field the inputs came in, which errors about them name; cache_salt: every input's
    (validate's rule: None or a non-empty string, else a 400 naming cache_salt)."""
    try:
        return [client.validate(msgspec.structs.replace(embedding_request(rid, x, client.context_len, i),
                                                        cache_salt=cache_salt))
                for i, (rid, x) in enumerate(zip(rids, ids))]
    except InvalidRequestError as e:  # validate names the prompt, embedding_request the input
        if e.param in ("prompt", "input"):
            e.param = param
        raise


async def run_admitted(state: GatewayState, client: EngineClient, base_id: str, reqs: list[GenerateRequest],
                       arrival: float, param: str = "input") -> list[list[float]]:
    """The requests' vectors under the gateway's admission, as Generation.respond runs a generation's
    choices: tracked (429 past --max-concurrent-requests; 503 once a drain began), admitted by the queue
    estimate (429 with Retry-After), untracked on every exit, each input's end counted in the metrics."""
    check_batch_size(state, len(reqs), param)
    tracked = state.track(base_id, reqs)
    try:
        await state.admit(client, reqs)
        return await run_embeddings(client, reqs, _metrics_hook(state, arrival))
    finally:
        state.untrack(base_id, tracked)


def check_batch_size(state: GatewayState, n: int, param: str, what: str = "inputs") -> None:
    """A batch that could never run at once (track and admit would name n or the prompt: here, the inputs'
    field, `param`); checked before the inputs are encoded, and again (run_admitted) on the requests made.
    what: the batch's items, in the message (inputs; score's pairs)."""
    for limit, flag in ((state.args.max_concurrent_requests, "--max-concurrent-requests"),
                        (state.admission.max_waiting_requests, "--max-waiting-requests")):
        if limit is not None and n > limit:
            raise bad_request(f"this request has {n} {what}; the server takes at most {limit} at once ({flag}): "
                              "send them in parts", param=param)


def _metrics_hook(state: GatewayState, arrival: float) -> OutputHook:
    """What ChoiceState counts for a generated choice, for an input: it started (admission's queue and
    start rate), then its end: e2e latency, queue time, and through finished() (which counts its prompt
    tokens) a finished request as vLLM counts a pooling one: n=1, nothing generated, no max_tokens."""
    def seen(req: GenerateRequest, out: RequestOutput) -> None:
        state.admission.started(req.rid)
        if out.finished:
            m = state.metrics
            m.queue_time.observe(max(out.queue_time_s, 0.0))
            m.e2e.observe(time.monotonic() - arrival)
            reason = out.finish_reason.openai_reason() if out.finish_reason is not None else "abort"
            m.finished(len(req.input_ids), 0, None, reason)
            m.finished_prompt(1, 0)
    return seen


async def run_embeddings(client: EngineClient, reqs: list[GenerateRequest],
                         hook: OutputHook | None = None) -> list[list[float]]:
    """Every request's vector, in order; the first failure cancels (and so aborts) the others. hook sees
    each output as it arrives."""
    return await gather_or_cancel(_one(client, r, hook) for r in reqs)


async def _one(client: EngineClient, req: GenerateRequest, hook: OutputHook | None) -> list[float]:
    last: Any = None
    async with contextlib.aclosing(client.stream(req)) as stream:
        async for o in stream:
            last = o
            if hook is not None:
                hook(req, o)
    if last is not None and last.embedding is not None:
        return last.embedding
    fr = last.finish_reason if last is not None else None
    message = (fr.message if fr is not None else None) or "the request ended without an embedding"
    if fr is not None and fr.kind == "abort":
        raise ApiError(503, f"the embedding request was aborted: {message}", code="request_aborted")
    if fr is not None and fr.code is not None:  # the engine's failure (unhealthy before running it): a 503
        raise ApiError(503, f"the embedding request failed: {message}", code=fr.code)
    raise ApiError(500, f"the embedding request failed: {message}")


def _encoded(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _is_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)

