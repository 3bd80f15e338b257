"""The non-OpenAI routes: SGLang-style POST /generate, POST /encode (an embedding server's), POST
/abort_request, GET /health, GET /health_generate, GET /metrics, and OpenAI's GET /v1/models and
GET /v1/models/{model}.

/generate streams like SGLang: every event carries the whole text and output_ids so far (not a delta)
with meta_info, whose finish_reason is null until the last event; then `data: [DONE]`. As SGLang's:
sampling_params.n > 1 answers a list (prompt by prompt, n each; a given seed is seed + j for choice j, as
on the OpenAI routes), sampling_params.sampling_seed is seed, and return_logprob gives meta_info
input_token_logprobs from logprob_start_len (-1, the default: the last prompt token only) to the prompt's
end, the first of them null ([logprob, id] or with text, as output_token_logprobs; input_top_logprobs with
top_logprobs_num)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from runtime.engine_client import EngineHealth
from runtime.errors import InvalidRequestError, ShoalError
from runtime.gateway.body import read_body
from runtime.gateway.choice_state import ChoiceState
from runtime.gateway.embeddings_protocol import EncodeMetaInfo, EncodeRequest, EncodeResponse
from runtime.gateway.errors import ApiError, bad_request, from_shoal_error
from runtime.gateway.generation import Generation, Responder
from runtime.gateway.openai_embeddings import embedding_requests, pooling_of, run_admitted
from runtime.gateway.openai_responder import score_prompts_once
from runtime.gateway.prompt_input import PromptInput
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
from runtime.gateway.state import STATE_KEY, GatewayState
from runtime.messages import GenerateRequest, RequestOutput
from runtime.sampling.params import SamplingParams

logger = logging.getLogger("shoal.gateway")

_HEALTH_GENERATE_TIMEOUT_S = 30.0


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(obj), content_type="application/json")


def _check_int64(sampling: dict[str, Any] | None) -> None:
    """sampling_params is free-form (SamplingParams.from_dict reads it), so protocol.Int64 cannot bound
    it: an integer no int64 tensor can hold is a 400 naming its key here, not a failed batch later."""
    for key, value in (sampling or {}).items():
        for v in value if isinstance(value, list) else (value,):
            if isinstance(v, int) and not -(2**63) <= v < 2**63:
                raise bad_request(f"sampling_params.{key} is out of range: {v} does not fit in 64 bits",
                                  param=f"sampling_params.{key}")


def _result(c: ChoiceState, scorer: ChoiceState, arrival: float, with_text: bool, tokenizer: Any,
            start: int) -> GenerateResponse:
    """Choice c's answer; scorer: the choice of its prompt that scored it (logprob_start_len `start`)."""
    fr = c.last.finish_reason if c.finished and c.last is not None else None
    finish = GenerateFinishReason(type=fr.kind, matched=fr.matched, message=fr.message) if fr else None
    if c.detok.stopped and (fr is None or fr.kind != "stop"):  # a stop string only the detokenizer saw
        finish = GenerateFinishReason(type="stop")
    meta = GenerateMetaInfo(
        id=c.req.rid, prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
        cached_tokens=c.cached_tokens, e2e_latency=time.monotonic() - arrival, finish_reason=finish)
    if c.req.sampling_params.return_logprob:
        tok = tokenizer.id_to_token_text

        def entry(lp: float | None, t: int) -> list[Any]:
            return [lp, t, tok(t)] if with_text else [lp, t]

        meta.output_token_logprobs = [entry(lp, t) for lp, t in zip(c.logprobs, c.ids)]
        ids = c.req.input_ids
        start = len(ids) - 1 if start == -1 else start
        lps, tops = scorer.input_logprobs, scorer.input_top_logprobs
        if start == len(ids) - 1 or lps is not None:  # else: not scored yet (a stream's event before the first delta)
            meta.input_token_logprobs = [entry(None if i == start else lps[i], ids[i]) for i in range(start, len(ids))]
        top_n = c.req.sampling_params.top_logprobs_num
        if top_n:
            meta.output_top_logprobs = [[entry(lp, t) for t, lp in step] for step in c.top_logprobs]
            if start == len(ids) - 1 or tops is not None:
                meta.input_top_logprobs = [None if i == start or not tops[i] else
                                           [entry(lp, t) for t, lp in tops[i][:top_n]] for i in range(start, len(ids))]
    return GenerateResponse(text=c.text, output_ids=list(c.ids), meta_info=meta)


async def generate(request: web.Request) -> web.StreamResponse:
    gen = await Generation.read(request, GenerateBody)
    body, client, state = gen.body, gen.client, gen.state
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text or input_ids", param="text")
    if body.text is not None:
        prompts = PromptInput.parse(body.text, client.tokenizer.encode, param="text")
    else:
        prompts = PromptInput.parse(body.input_ids, client.tokenizer.encode, param="input_ids", allow_text=False)
    _check_int64(body.sampling_params)
    if body.custom_logit_processor:
        raise bad_request("custom_logit_processor (server-side code) is not supported", param="custom_logit_processor")
    sampling, n = _split_n(body.sampling_params, state.args.max_n)
    if (prompts.batch or n > 1) and body.stream:
        raise bad_request("streaming a batch (several prompts, or sampling_params.n > 1) is not supported; send "
                          "one request per prompt and choice", param="stream")
    start = _logprob_start(body, prompts.ids)
    try:
        params = SamplingParams.from_dict(sampling, state.sampling_defaults(client))  # unset: the model's defaults
        if body.return_logprob:
            params = msgspec.structs.replace(params, return_logprob=True, top_logprobs_num=body.top_logprobs_num)
            params.validate()
    except InvalidRequestError as e:
        raise from_shoal_error(e) from None
    base = body.rid or state.new_id("gen")
    lora = (state.adapter_of(body.lora_name, "lora_name") if body.lora_name is not None
            else state.adapter_of(body.lora_path, "lora_path"))
    several = prompts.batch or n > 1
    reqs = []
    for p, ids in enumerate(prompts.ids):
        # From the last position on there is nothing to score (its logprob is null): only an earlier start asks
        scored = body.return_logprob and -1 < start < len(ids) - 1
        for j in range(n):
            pj = params if params.seed is None or not j else msgspec.structs.replace(
                params, seed=(params.seed + j) % 2**63)
            reqs.append(GenerateRequest(rid=f"{base}-{p * n + j}" if several else base, input_ids=ids,
                                        sampling_params=pj, lora_name=lora, priority=body.priority or 0, cache_salt=body.cache_salt,
                                        return_input_logprob=scored,
                                        input_top_logprobs_num=body.top_logprobs_num if scored else 0))
    reqs = [state.validate(client, r) for r in score_prompts_once(reqs, n)]  # a prompt's n choices share one score
    if params.grammar is not None:  # json_schema, regex or ebnf: compiled (or refused) before anything runs
        await state.check_grammar(client, reqs[0], f"sampling_params.{params.grammar[0]}")
    gen.set_choices(base, reqs)
    return await gen.respond(body.stream, _GenerateResponder(gen, body.return_text_in_logprobs, several, n, start))


def _split_n(sampling: dict[str, Any] | None, max_n: int) -> tuple[dict[str, Any] | None, int]:
    """(sampling_params without n, n): SGLang's n choices of each prompt."""
    if not isinstance(sampling, dict) or "n" not in sampling:
        return sampling, 1
    sampling = dict(sampling)
    n = sampling.pop("n")
    if n is None:
        return sampling, 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_n:
        raise bad_request(f"sampling_params.n must be an integer in [1, {max_n}] on this server (--max-n), "
                          f"got {n!r}", param="sampling_params.n")
    return sampling, n


def _logprob_start(body: GenerateBody, prompts: list[list[int]]) -> int:
    """logprob_start_len, checked against every prompt (-1: each prompt's last token)."""
    start = body.logprob_start_len
    if start < -1:
        raise bad_request(f"logprob_start_len must be -1 (the last prompt token) or a prompt position >= 0, "
                          f"got {start}", param="logprob_start_len")
    shortest = min(len(ids) for ids in prompts)
    if body.return_logprob and start >= shortest:
        raise bad_request(f"logprob_start_len {start} is past the prompt's end: it has {shortest} tokens",
                          param="logprob_start_len")
    return start


async def encode_request(request: web.Request) -> web.Response:
    """SGLang's embedding route: `text` (a string or strings) or `input_ids` (ids or lists of ids) →
    {"embedding", "meta_info"}, a list of them for a batch; `rid` a string or, for a batch, a list of one
    per input (SGLang's). Admitted, tracked and counted as /v1/embeddings is (openai_embeddings.run_admitted).
    On a generation server a 400, as that route. Sentence-transformers prompts are not applied here (nor by
    vLLM's server): the text is embedded as sent."""
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    body = await read_body(request, EncodeRequest)
    client = state.client()
    pooling = pooling_of(client)
    pooling.check_dimensions(body.dimensions)
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text or input_ids", param="text")
    param = "text" if body.text is not None else "input_ids"
    prompts = PromptInput.parse(body.text if body.text is not None else body.input_ids, client.tokenizer.encode,
                                param=param, allow_text=body.text is not None)
    base, rids = _encode_rids(body.rid, len(prompts.ids), prompts.batch, state.new_id("embd"))
    reqs = embedding_requests(client, rids, prompts.ids, param, cache_salt=body.cache_salt)
    vectors = await run_admitted(state, client, base, reqs, arrival, param)
    latency = time.monotonic() - arrival
    out = [EncodeResponse(pooling.shorten(v, body.dimensions), EncodeMetaInfo(r.rid, len(r.input_ids), latency))
           for r, v in zip(reqs, vectors)]
    return _json(out if prompts.batch else out[0])


def _encode_rids(rid: str | list[str] | None, n: int, batch: bool, fresh: str) -> tuple[str, list[str]]:
    """(the tracking id, each input's rid) for /encode: a list names each input (SGLang's batch form), a
    string is the single input's rid or a batch's base (suffixed -i), None a fresh one."""
    if not isinstance(rid, list):
        base = rid or fresh
        return base, [f"{base}-{i}" for i in range(n)] if batch else [base]
    if len(rid) != n:
        raise bad_request(f"rid lists {len(rid)} ids for {n} input{'s' if n != 1 else ''}: give one per input",
                          param="rid")
    if not all(rid) or len(set(rid)) != n:
        raise bad_request("rid's ids must be non-empty and distinct", param="rid")
    return (rid[0] if n == 1 else fresh), list(rid)  # /abort_request finds each input by its own rid


class _GenerateResponder(Responder):
    """SGLang's shape: each stream event is the whole answer so far, not a delta."""

    fail_on_engine_error = False  # meta_info.finish_reason says "error" with its message

    def __init__(self, gen: Generation, with_text: bool, several: bool, n: int, start: int):
        self.choices, self.arrival, self.tokenizer = gen.choices, gen.arrival, gen.client.tokenizer
        self.with_text, self.several, self.n, self.start = with_text, several, n, start

    def _result(self, c: ChoiceState) -> GenerateResponse:
        scorer = self.choices[c.index - c.index % self.n]
        return _result(c, scorer, self.arrival, self.with_text, self.tokenizer, self.start)

    def body(self) -> GenerateResponse | list[GenerateResponse]:
        results = [self._result(c) for c in self.choices]
        return results if self.several else results[0]

    def events(self, c: ChoiceState, out: RequestOutput, text: str) -> list[GenerateResponse]:
        return [self._result(c)]


async def abort_request(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await read_body(request, AbortRequestBody)
    client = state.client()
    rids = state.rids_of(body.rid)  # a response id, an X-Request-Id, or one engine request's rid
    for rid in rids:
        await client.abort(rid)
    return _json({"aborted": rids})


async def health(request: web.Request) -> web.Response:
    """200 while the engine serves; 503 {"status": "unhealthy", "reason"} once it cannot (EngineClient.health: its
    steps keep failing or met a dead device, as vLLM's /health after EngineDeadError; on Ray, no replica left to
    serve), so a liveness probe restarts the server; 503 engine_not_ready while it starts or shuts down."""
    state = request.app[STATE_KEY]
    down = _unhealthy(state)
    if down is not None:
        return _json({"status": "unhealthy", "reason": down.reason}, status=503)
    client = state.current_client()
    if client is None:
        raise ApiError(503, "not ready: the engine is starting or shutting down", code="engine_not_ready")
    routing = client.routing_stats()
    if routing is None or not routing.alive:
        return _json({"status": "ok"})
    # Still 200 while any replica serves (a load balancer should keep sending here); the body tells a probe
    # or an operator that some replica is down or relaunching.
    up = sum(routing.alive)
    status = "ok" if up == len(routing.alive) else "degraded"
    return _json({"status": status, "replicas_up": up, "replicas": len(routing.alive)})


def _unhealthy(state: GatewayState) -> EngineHealth | None:
    """The engine's health when it says it cannot serve, asked even when it is not ready (on Ray, not ready
    means no replica is live: the reason says why); None while it can, loads, or shuts down."""
    client = None if state.shutting_down else state.provider()
    if client is None:
        return None
    try:
        health = client.health()
    except Exception:  # cannot tell: readiness decides (a false 503 would have a probe restart a good server)
        logger.warning("could not read the engine's health", exc_info=True)
        return None
    return None if health.healthy else health


async def health_generate(request: web.Request) -> web.Response:
    """Ready and able to generate: runs one greedy token (an unhealthy engine answers 503 with its reason
    without one). While generation is paused (/pause_generation) a probe would wait for
    /continue_generation, so it answers 200 without one, as SGLang's: a paused engine is healthy (its body
    says paused)."""
    state = request.app[STATE_KEY]
    down = _unhealthy(state)
    if down is not None:
        raise ApiError(503, f"generation check failed: the engine is unhealthy: {down.reason}", code="unhealthy")
    client = state.client()
    paused = await _paused_replicas(client)
    if paused:
        return _json({"status": "ok", "generation": "paused",
                      "message": f"generation is paused on {paused} scheduler{'s' if paused != 1 else ''} "
                                 "(/pause_generation): no probe was run; /continue_generation resumes it"})
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


async def _paused_replicas(client: Any) -> int:
    """How many schedulers say they are paused (their stats); 0 when the stats cannot be read: the probe then
    finds out what is wrong."""
    try:
        stats = await client.stats()
    except Exception:
        logger.debug("could not read scheduler stats for /health_generate", exc_info=True)
        return 0
    return getattr(stats, "paused_replicas", 0)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    client = state.current_client()
    stats, replicas = None, None
    if client is not None:
        try:
            stats = await client.stats()
            per_replica = getattr(client, "replica_stats", None)  # the Ray client's, one per replica / DP rank
            replicas = list(await per_replica()) if callable(per_replica) else [stats]
        except Exception:  # a scrape must not fail because one replica is slow to answer
            logger.warning("could not read scheduler stats for /metrics", exc_info=True)
    estimate = routing = None
    if stats is not None:
        state.admission.observe(time.monotonic(), stats)
        estimate = state.admission.scaled(state.admission.estimator.estimate(stats, 0))
        routing = client.routing_stats()
    return web.Response(body=state.metrics.render(stats, estimate, routing, replicas),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


def _model_card(request: web.Request) -> ModelCard:
    """The card of the name in the path (a served name's own, the first served name's for the model's own
    name), or of the first served name without one; a 404 model_not_found for a name not served."""
    state = request.app[STATE_KEY]
    client = state.client()
    asked = request.match_info.get("model")
    name = state.check_model(client, asked)
    card = ModelCard(id=asked if asked in state.served_names(client) else state.served_model(client),
                     created=state.created, root=client.model_name, max_model_len=client.context_len)
    if name in state.lora_adapters:  # an adapter's card (vLLM's: its folder as root, the first name as parent)
        return _adapter_card(card, name, state.lora_adapters[name])
    return card


async def models(request: web.Request) -> web.Response:
    base = _model_card(request)
    state = request.app[STATE_KEY]
    # vLLM's show_available_models: one card per served name, then one per --lora-modules adapter
    names = state.served_names(state.client())
    cards = [msgspec.structs.replace(base, id=name) for name in names]
    cards += [_adapter_card(base, name, path) for name, path in state.lora_adapters.items()]
    return _json(ModelList(data=cards))


def _adapter_card(base: ModelCard, name: str, path: str) -> ModelCard:
    """vLLM's card of an adapter: its folder as root, the base model as parent."""
    return msgspec.structs.replace(base, id=name, root=path, parent=base.id)


async def model(request: web.Request) -> web.Response:
    """OpenAI's retrieve: the card of a name the generating routes accept (a served name, or the model's
    own when --served-model-name renames it), else 404 model_not_found."""
    return _json(_model_card(request))


async def version(request: web.Request) -> web.Response:
    """vLLM's GET /version: which Shoal serves (deployment checks, bug reports)."""
    try:
        v = importlib.metadata.version("shoal")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        v = "unknown"
    return _json({"version": v})
