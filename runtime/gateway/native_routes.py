"""The non-OpenAI routes: SGLang-style POST /generate, POST /encode (an embedding server's), POST
/abort_request, GET /metrics, and OpenAI's GET /v1/models and GET /v1/models/{model} (the health routes:
health_routes.py).

/generate streams like SGLang: every event carries the whole text and output_ids so far (not a delta)
with meta_info, whose finish_reason is null until the last event; then `data: [DONE]`. As SGLang's:
sampling_params.n > 1 answers a list (prompt by prompt, n each; a given seed is seed + j for choice j, as
on the OpenAI routes), sampling_params.sampling_seed is seed, and return_logprob gives meta_info
input_token_logprobs from logprob_start_len (-1, the default: the last prompt token only) to the prompt's
end, the first of them null ([logprob, id] or with text, as output_token_logprobs; input_top_logprobs with
top_logprobs_num)."""

from __future__ import annotations

import importlib.metadata
import logging
import re
import time
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from runtime.errors import InvalidRequestError
from runtime.gateway.body import read_body
from runtime.gateway.choice_state import ChoiceState
from runtime.gateway.embeddings_protocol import EncodeMetaInfo, EncodeRequest, EncodeResponse
from runtime.gateway.errors import bad_request, from_shoal_error
from runtime.gateway.generation import Generation, Responder
from runtime.gateway.openai_embeddings import embedding_requests, pooling_of, run_admitted
from runtime.gateway.openai_responder import score_prompts_once
from runtime.gateway.prompt_input import PromptInput, prompt_count
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
from runtime.gateway.request_ids import ID_RULE, current_scope, well_formed_id
from runtime.gateway.state import STATE_KEY
from runtime.messages import GenerateRequest, RequestOutput
from runtime.sampling.params import SamplingParams

logger = logging.getLogger("shoal.gateway")

def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(obj), content_type="application/json")


# /abort_request's rid may also be an engine rid made from a client's id, longer by its prefix and suffixes
# (chatcmpl-<id>-<8 hex>-<k>); visible ASCII either way, as the logs print it.
_ABORTABLE = re.compile(r"[\x21-\x7e]{1,512}")


def _check_rid(rid: str, abort: bool = False) -> str:
    """A client's rid, as request_ids.py takes a client's id: the logs print it and engine rids start with it."""
    if not (_ABORTABLE.fullmatch(rid) if abort else well_formed_id(rid)):
        rule = "1-512 visible ASCII characters (no spaces)" if abort else ID_RULE
        raise bad_request(f"rid must be {rule}, got {rid[:64]!r}", param="rid")
    return rid


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


async def _prompts(request: web.Request, state: Any, client: Any, text: object, input_ids: object,
                   n: int = 1) -> PromptInput:
    """SGLang's text or input_ids, bounded before any encoding as the OpenAI routes are (PromptInput.read): the
    prompt count (each prompt makes n requests), each text against the context, and a large body encoded off
    the loop."""
    limit = max(1, state.batch_limit() // n)
    if text is not None:
        return await PromptInput.read(text, client.tokenizer, client.context_len, request, limit,
                                      param="text")
    if prompt_count(input_ids) > limit:
        raise bad_request(f"this request has {prompt_count(input_ids)} prompts; the server takes at most {limit} "
                          "at once: send them in parts", param="input_ids")
    return PromptInput.parse(input_ids, client.tokenizer.encode, param="input_ids", allow_text=False)


async def generate(request: web.Request) -> web.StreamResponse:
    gen = await Generation.read(request, GenerateBody)
    body, client, state = gen.body, gen.client, gen.state
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text or input_ids", param="text")
    sampling, n = _split_n(body.sampling_params, state.args.max_n)
    prompts = await _prompts(request, state, client, body.text, body.input_ids, n)
    _check_int64(body.sampling_params)
    if body.custom_logit_processor:
        raise bad_request("custom_logit_processor (server-side code) is not supported", param="custom_logit_processor")
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
    base = _check_rid(body.rid) if body.rid is not None else state.new_id("gen")
    scope = current_scope()
    if body.rid is not None and scope is not None and scope.base is None:
        scope.base = base  # X-Request-Id (and the access log) answer with the body's rid, as new_id's would
    lora = (state.adapter_of(body.lora_name, "lora_name") if body.lora_name is not None
            else state.adapter_of(body.lora_path, "lora_path"))
    several = prompts.batch or n > 1
    reqs = []
    for p, prompt in enumerate(prompts.ids):
        ids = tuple(prompt)  # one tuple for the prompt's n choices: the request log logs it once
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
        await state.check_grammar(client, reqs[0], f"sampling_params.{params.grammar[0]}", request)
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
    prompts = await _prompts(request, state, client, body.text, body.input_ids)
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
        base = fresh if rid is None else _check_rid(rid)
        return base, [f"{base}-{i}" for i in range(n)] if batch else [base]
    if len(rid) != n:
        raise bad_request(f"rid lists {len(rid)} ids for {n} input{'s' if n != 1 else ''}: give one per input",
                          param="rid")
    for r in rid:
        _check_rid(r)
    if len(set(rid)) != n:
        raise bad_request("rid's ids must be distinct", param="rid")
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
    # A response id, an X-Request-Id, or one engine request's rid
    rids = state.rids_of(_check_rid(body.rid, abort=True))
    for rid in rids:
        await client.abort(rid)
    return _json({"aborted": rids})


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
