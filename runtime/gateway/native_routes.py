"""The non-OpenAI routes: SGLang-style POST /generate, POST /abort_request, GET /health,
GET /health_generate, GET /metrics, and OpenAI's GET /v1/models.

/generate streams like SGLang: every event carries the whole text and output_ids so far (not a delta)
with meta_info, whose finish_reason is null until the last event; then `data: [DONE]`."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from runtime.errors import InvalidRequestError, ShoalError
from runtime.gateway.body import read_body
from runtime.gateway.choice_state import ChoiceState
from runtime.gateway.errors import ApiError, bad_request, from_shoal_error
from runtime.gateway.fan_in import OutputFanIn
from runtime.gateway.protocol import (
    AbortRequestBody,
    GenerateBody,
    GenerateFinishReason,
    GenerateMetaInfo,
    GenerateResponse,
    ModelCard,
    ModelList,
    encode,
)
from runtime.gateway.sse import SseWriter, is_disconnected
from runtime.gateway.state import STATE_KEY
from runtime.messages import GenerateRequest
from runtime.sampling.params import SamplingParams

logger = logging.getLogger("shoal.gateway")

_HEALTH_GENERATE_TIMEOUT_S = 30.0


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(obj), content_type="application/json")


def _inputs(body: GenerateBody, encode_text: Any) -> tuple[list[list[int]], bool]:
    """(token ids per prompt, whether the body was a batch)."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text or input_ids", param="text")
    if isinstance(body.text, str):
        return [encode_text(body.text)], False
    if body.text is not None:
        if not body.text:
            raise bad_request("text must not be an empty list", param="text")
        return [encode_text(t) for t in body.text], True
    ids = body.input_ids

    def is_int(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if ids and all(is_int(t) for t in ids):
        return [list(ids)], False
    if ids and all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in ids):
        return [list(p) for p in ids], True
    raise bad_request("input_ids must be a non-empty list of token ids or of non-empty token-id lists",
                      param="input_ids")


def _check_int64(sampling: dict[str, Any] | None) -> None:
    """sampling_params is free-form (SamplingParams.from_dict reads it), so protocol.Int64 cannot bound
    it: an integer no int64 tensor can hold is a 400 naming its key here, not a failed batch later."""
    for key, value in (sampling or {}).items():
        for v in value if isinstance(value, list) else (value,):
            if isinstance(v, int) and not -(2**63) <= v < 2**63:
                raise bad_request(f"sampling_params.{key} is out of range: {v} does not fit in 64 bits",
                                  param=f"sampling_params.{key}")


def _result(c: ChoiceState, arrival: float, with_text: bool, tokenizer: Any) -> GenerateResponse:
    fr = c.last.finish_reason if c.finished and c.last is not None else None
    meta = GenerateMetaInfo(
        id=c.req.rid, prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
        cached_tokens=c.cached_tokens, e2e_latency=time.monotonic() - arrival,
        finish_reason=GenerateFinishReason(type=fr.kind, matched=fr.matched, message=fr.message) if fr else None)
    if c.req.sampling_params.return_logprob:
        tok = tokenizer.id_to_token_text
        meta.output_token_logprobs = [[lp, t, tok(t)] if with_text else [lp, t] for lp, t in zip(c.logprobs, c.ids)]
        if c.req.sampling_params.top_logprobs_num:
            meta.output_top_logprobs = [[[lp, t, tok(t)] if with_text else [lp, t] for t, lp in step]
                                        for step in c.top_logprobs]
    return GenerateResponse(text=c.text, output_ids=list(c.ids), meta_info=meta)


async def generate(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    body = await read_body(request, GenerateBody)
    client = state.client()
    prompts, batch = _inputs(body, client.tokenizer.encode)
    if batch and body.stream:
        raise bad_request("streaming a batch is not supported; send one request per prompt", param="stream")
    _check_int64(body.sampling_params)
    try:
        params = SamplingParams.from_dict(body.sampling_params)
        if body.return_logprob:
            params = msgspec.structs.replace(params, return_logprob=True, top_logprobs_num=body.top_logprobs_num)
            params.validate()
    except InvalidRequestError as e:
        raise from_shoal_error(e) from None
    base = body.rid or state.new_id("gen")
    reqs = [state.validate(client, GenerateRequest(rid=f"{base}-{k}" if batch else base, input_ids=ids,
                                                   sampling_params=params)) for k, ids in enumerate(prompts)]
    choices = [ChoiceState(i, r, client.tokenizer, state.metrics, arrival) for i, r in enumerate(reqs)]
    tracked = state.track(base, reqs)
    try:
        fan = OutputFanIn(client, reqs, lambda: is_disconnected(request))
        if not body.stream:
            async with fan:
                async for i, out in fan:
                    choices[i].add(out)
            results = [_result(c, arrival, body.return_text_in_logprobs, client.tokenizer) for c in choices]
            return _json(results if batch else results[0])
        sse = SseWriter(request)
        await sse.start()
        try:
            async with fan:
                async for i, out in fan:
                    choices[i].add(out)
                    await sse.send(encode(_result(choices[i], arrival, body.return_text_in_logprobs,
                                                  client.tokenizer)))
            return await sse.finish()
        except (ApiError, ShoalError) as e:
            return await sse.end_on_error(e)
    finally:
        state.untrack(base, tracked)


async def abort_request(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await read_body(request, AbortRequestBody)
    client = state.client()
    rids = state.inflight.get(body.rid, [body.rid])
    for rid in rids:
        await client.abort(rid)
    return _json({"aborted": rids})


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.current_client() is None:
        raise ApiError(503, "not ready: the engine is starting or shutting down", code="engine_not_ready")
    return _json({"status": "ok"})


async def health_generate(request: web.Request) -> web.Response:
    """Ready and able to generate: runs one greedy token."""
    state = request.app[STATE_KEY]
    client = state.client()
    ids = [0] if getattr(client.tokenizer, "is_null", False) else client.tokenizer.encode("ping") or [0]
    req = GenerateRequest(rid=state.new_id("health"), input_ids=ids,
                          sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))

    async def one_token() -> str | None:
        async for out in client.stream(client.validate(req)):
            if out.finished:
                fr = out.finish_reason
                return fr.message if fr is not None and fr.kind == "error" else None
        return "the stream ended without finishing"

    try:
        error = await asyncio.wait_for(one_token(), _HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        error = f"no token within {_HEALTH_GENERATE_TIMEOUT_S:.0f} s"
    except ShoalError as e:
        error = str(e)
    if error is not None:
        raise ApiError(503, f"generation check failed: {error}", code="unhealthy")
    return _json({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    client = state.current_client()
    stats = None
    if client is not None:
        try:
            stats = await client.stats()
        except Exception:  # a scrape must not fail because one replica is slow to answer
            logger.warning("could not read scheduler stats for /metrics", exc_info=True)
    return web.Response(body=state.metrics.render(stats), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    client = state.client()
    card = ModelCard(id=state.served_model(client), created=state.created, root=client.model_name,
                     max_model_len=client.context_len)
    return _json(ModelList(data=[card]))
