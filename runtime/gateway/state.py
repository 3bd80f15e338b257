"""GatewayState: what every handler of one app shares — the server args, the EngineClient (or the
provider that returns it once loaded), the metrics, and the rids of requests in flight (so
/abort_request can name a whole n>1 request by its response id).

Response ids named by the client (X-Request-Id, or the body's request_id) are request_ids.py's: new_id,
request_scope and rids_of hand over to it."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.metadata
import re
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import msgspec
from aiohttp import web

from runtime.config import ServerArgs
from runtime.default_model import DEFAULT_MODEL_NAME, default_cache_root
from runtime.engine_client import EngineClient
from runtime.errors import InvalidRequestError, ShoalError
from runtime.gateway.admission import AdmissionController
from runtime.gateway.dashboard import Dashboard
from runtime.gateway.error_log import ErrorLog
from runtime.gateway.errors import ApiError, bad_request, from_shoal_error
from runtime.gateway.ignored_fields import IgnoredFields
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.protocol import OpenAISamplingFields
from runtime.gateway.request_ids import RequestIds
from runtime.gateway.request_log import RequestLog
from runtime.gateway.sse import unless_gone
from runtime.gateway.ttft_trace import TtftTrace
from runtime.messages import GenerateRequest
from runtime.model_names import BaseModelNames
from runtime.sampling.generation_defaults import GenerationDefaults
from runtime.sampling.params import SamplingParams
from runtime.text.bad_words import tokenize_bad_words

ClientProvider = Callable[[], EngineClient | None]

_TOKEN_ID = re.compile(r"-?[0-9]+")
# Our SamplingParams names → the OpenAI request field a user wrote, for error messages.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs_num": "logprobs"}


@functools.cache
def shoal_version() -> str:
    try:
        return importlib.metadata.version("shoal")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+checkout"


class GatewayState:
    def __init__(self, client_provider: EngineClient | ClientProvider, args: ServerArgs):
        if hasattr(client_provider, "stream"):  # a ready client rather than a provider
            client = client_provider
            self.provider: ClientProvider = lambda: client
        else:
            self.provider = client_provider
        self.args = args
        self.metrics = GatewayMetrics(args.metrics_compat_names, model_name=self._served_model_name,
                                      max_model_len=self._max_model_len)
        self.admission = AdmissionController(args.max_queue_wait_s, args.max_waiting_requests)
        self.ignored_fields = IgnoredFields(self.metrics.ignored_fields)
        self.errors = ErrorLog()
        self.ttft_trace = TtftTrace()
        self.dashboard = Dashboard(self.metrics, self.errors)
        self.request_log = RequestLog(args.enable_log_requests, args.max_log_len)  # and the access log's ids
        self.created = int(time.time())
        self.shutting_down = False
        self.inflight: dict[str, list[str]] = {}  # response id → rids of its choices
        self.ids = RequestIds(self.inflight)  # the response ids clients named
        self.active = 0  # choices in flight, against --max-concurrent-requests
        self._sampling_defaults: GenerationDefaults | None = None  # sampling_defaults() reads them once
        self._base_names: tuple[EngineClient, BaseModelNames] | None = None  # base_names(): once per client

    # ---- the engine -------------------------------------------------------------------------------
    def current_client(self) -> EngineClient | None:
        client = self.provider()
        if client is None or self.shutting_down:
            return None
        try:
            return client if client.is_ready() else None
        except Exception:  # a client that cannot even say whether it is ready is not
            return None

    def client(self) -> EngineClient:
        """The ready client, or a 503 while the engine loads or shuts down."""
        client = self.current_client()
        if client is None:
            reason = None if self.shutting_down else self._unhealthy_reason()
            if reason is not None:  # every replica down (Ray): not "still starting"
                raise ApiError(503, f"the engine is unhealthy: {reason}", code="engine_unhealthy")
            what = "shutting down" if self.shutting_down else "still starting (loading the model)"
            raise ApiError(503, f"the server is {what}; retry shortly", code="engine_not_ready")
        return client

    def _unhealthy_reason(self) -> str | None:
        client = self.provider()
        try:
            health = client.health() if client is not None else None
        except Exception:  # a client that cannot say: the readiness answer stands
            return None
        return None if health is None or health.healthy else (health.reason or "no reason given")

    @property
    def lora_adapters(self) -> dict[str, str]:
        """--enable-lora: the adapters served now (start-up's, and those loaded since: lora_routes.py), name →
        folder; requests give the name as `model` (the response echoes it)."""
        client = self.current_client() if self.args.enable_lora else None
        return client.lora_adapters() if client is not None else {}

    def served_model(self, client: EngineClient) -> str:
        """The name responses (and metrics) carry: --served-model-name's first, else the model's own."""
        return self.args.served_model_name or client.model_name

    def served_names(self, client: EngineClient) -> tuple[str, ...]:
        """Every name served, first the one responses carry (vLLM's --served-model-name a b c: a, b, c)."""
        return (self.served_model(client), *(self.args.served_model_aliases or ()))

    def _served_model_name(self) -> str | None:
        """The served model's name as a scrape sees it (the compat metrics' model_name label)."""
        client = self.current_client()
        return self.served_model(client) if client is not None else self.args.served_model_name

    def _max_model_len(self) -> int | None:
        """The context length as the metrics see it (vLLM's token histograms' buckets; None while loading)."""
        client = self.current_client()
        return client.context_len if client is not None else None

    def system_fingerprint(self, client: EngineClient) -> str:
        """OpenAI's system_fingerprint: names the serving configuration (Shoal's version, the model and
        its context), so a client sees when answers to the same request may change."""
        key = f"shoal {shoal_version()} {client.model_name} {client.context_len}"
        return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:12]

    def check_model(self, client: EngineClient, model: str | None) -> str:
        """The model name a response carries; a 404 model_not_found for a name this server does not serve.
        Without --served-model-name a request may also name the base model as vLLM's and SGLang's clients do:
        --model-path as typed, the folder loaded, or "default" (BaseModelNames; a served name keeps vLLM's
        rule: only the served names)."""
        names = self.served_names(client)
        if model in self.lora_adapters:
            return model
        if model is None or model in names or model == client.model_name:
            return names[0]
        if self.args.served_model_name is None and model in self.base_names(client):
            return names[0]
        raise ApiError(404, f"The model `{model}` does not exist. This server serves "
                            + ", ".join(f"`{n}`" for n in (*names, *self.lora_adapters)) + ".",
                            param="model", code="model_not_found")

    def base_names(self, client: EngineClient) -> BaseModelNames:
        """BaseModelNames of client, built once per client: for a Ray client it walks the HF cache, which
        would otherwise run on the event loop for every request naming the model by path or "default"."""
        cached = self._base_names
        if cached is None or cached[0] is not client:
            cached = self._base_names = (client, BaseModelNames.of(
                self.args.model_path, getattr(client, "model_path", None), self.args.revision))
        return cached[1]

    def lora_name(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model)."""
        return model if model in self.lora_adapters else None

    def adapter_of(self, value: str | None, param: str) -> str | None:
        """The adapter SGLang's lora_path / lora_name names, by its name or its --lora-modules folder (None:
        the base model); a 400 naming param if none is served so."""
        if value is None or value in self.lora_adapters:
            return value
        by_path = {path: name for name, path in self.lora_adapters.items()}
        if value not in by_path:
            served = ", ".join(self.lora_adapters) or "none; start with --lora-modules"
            raise bad_request(f"no LoRA adapter {value!r} is served (adapters: {served})", param=param)
        return by_path[value]

    def check_n(self, n: int | None) -> int:
        n = 1 if n is None else n
        if not 1 <= n <= self.args.max_n:
            raise bad_request(f"n must be in [1, {self.args.max_n}] on this server, got {n}", param="n")
        return n

    def usage_modes(self, body: OpenAISamplingFields) -> tuple[bool, bool]:
        """(a final usage chunk, usage in every chunk) from stream_options, which, as in OpenAI's API and
        vLLM's, only a streaming request may send; --enable-force-include-usage streams both whatever the
        request says (vLLM's should_include_usage: a usage-metering proxy must see every stream's tokens)."""
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.args.enable_force_include_usage and body.stream:
            return True, True
        if body.stream_options is None:
            return False, False
        return body.stream_options.usage_modes()

    # ---- building requests ------------------------------------------------------------------------
    def sampling_defaults(self, client: EngineClient | None = None) -> GenerationDefaults:
        """The defaults of what requests leave unset (the model's generation_config.json), read once: an
        in-process Engine's own, else from these args and the client's model folder."""
        if self._sampling_defaults is None:
            client = client if client is not None else self.provider()
            found = getattr(client, "generation_defaults", None)
            if not isinstance(found, GenerationDefaults):
                # the default model's folder where neither names one (never built here: a client has run it)
                folder = (getattr(client, "model_path", None) or self.args.model_path
                          or default_cache_root() / DEFAULT_MODEL_NAME)
                found = GenerationDefaults.for_server(self.args, folder)
            self._sampling_defaults = found
        return self._sampling_defaults

    def sampling_params(self, body: OpenAISamplingFields, max_new_tokens: int, return_logprob: bool = False,
                        top_logprobs_num: int = 0, logprob_param: str = "logprobs", max_param: str = "max_tokens",
                        max_given: bool | None = None) -> SamplingParams:
        """SamplingParams from the OpenAI fields of a completions or chat body (None = the server's default).
        max_new_tokens: the request's own, or (max_given false) the room the context leaves it, which the
        model's default max_tokens may lower; max_given None reads the body's max_param field (a body without
        that field: given)."""
        if max_given is None:
            max_given = getattr(body, max_param, max_new_tokens) is not None
        fields = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                  "repetition_penalty": "repetition_penalty", "stop_token_ids": "stop_token_ids",
                  "seed": "seed", "ignore_eos": "ignore_eos", "min_tokens": "min_new_tokens",
                  "skip_special_tokens": "skip_special_tokens", "allowed_token_ids": "allowed_token_ids",
                  "bad_words": "bad_words"}
        kw: dict[str, Any] = {ours: getattr(body, theirs) for theirs, ours in fields.items()
                              if getattr(body, theirs) is not None}
        stop = body.stop
        if stop is not None:
            kw["stop"] = [stop] if isinstance(stop, str) else list(stop)
        if body.logit_bias:  # OpenAI sends token ids as JSON object keys, so as strings
            if not all(_TOKEN_ID.fullmatch(t) for t in body.logit_bias):
                raise bad_request("logit_bias keys must be token ids (integers as strings)", param="logit_bias")
            kw["logit_bias"] = {int(t): float(v) for t, v in body.logit_bias.items()}
        names = {**_OPENAI_NAMES, "top_logprobs_num": logprob_param, "max_new_tokens": max_param}
        defaults = self.sampling_defaults()
        if not max_given and defaults.max_new_tokens is not None:
            max_new_tokens = min(max_new_tokens, defaults.max_new_tokens)
        kw = defaults.fill({**kw, "max_new_tokens": max_new_tokens})
        try:
            params = SamplingParams(return_logprob=return_logprob, top_logprobs_num=top_logprobs_num, **kw)
            params.validate()
        except InvalidRequestError as e:
            param = names.get(e.param or "", e.param)
            message = e.message
            for ours, theirs in names.items():
                message = message.replace(ours, theirs)
            raise bad_request(message, param=param) from None
        return params

    def request_scope(self, header: str | None) -> AbstractContextManager[None]:
        """Around one handler (app.py's middleware): header is its X-Request-Id (None: not sent)."""
        return self.ids.scope(header)

    def new_id(self, prefix: str, sep: str = "-", request_id: str | None = None, as_sent: bool = False) -> str:
        """A response id: "<prefix><sep><X-Request-Id or the body's request_id>" or a random one (RequestIds)."""
        return self.ids.new_id(prefix, sep, request_id, as_sent)

    def rids_of(self, rid: str) -> list[str]:
        """What /abort_request stops for rid: a response id's choices, a client id's requests, or rid itself."""
        return self.ids.rids_of(rid)

    def choice_requests(self, client: EngineClient, base_id: str, prompts: list[list[int]],
                        params: SamplingParams, n: int, return_input_logprob: bool = False,
                        input_top_logprobs_num: int = 0, lora_name: str | None = None,
                        cache_salt: str | None = None) -> list[GenerateRequest]:
        """n requests per prompt (choice index = prompt * n + i), each validated before any is sent so
        a bad one leaves nothing running. A given seed becomes seed + i: choices differ, reproducibly."""
        params = self.with_bad_words_ids(client, params)  # once for all the choices, not in each validate
        reqs = []
        for p, prompt in enumerate(prompts):
            ids = tuple(prompt)  # one copy shared by the n choices (GenerateRequest makes a list a tuple)
            for i in range(n):
                pi = params
                if params.seed is not None and i:
                    pi = msgspec.structs.replace(params, seed=(params.seed + i) % 2**63)
                req = GenerateRequest(rid=f"{base_id}-{p * n + i}", input_ids=ids, sampling_params=pi,
                                      return_input_logprob=return_input_logprob,
                                      input_top_logprobs_num=input_top_logprobs_num, lora_name=lora_name,
                                      cache_salt=cache_salt)
                reqs.append(self.validate(client, req))
        return reqs

    @staticmethod
    async def check_grammar(client: EngineClient, req: GenerateRequest, param: str,
                            request: web.Request | None = None) -> None:
        """Compiles the request's grammar before anything is sent (the choices of a request share it, and
        the compile is cached): an invalid one or one past --grammar-compile-timeout-s is a 400 naming
        `param`, the body field that gave it. A client that leaves meanwhile (request's connection closed)
        stops waiting at once (RequestAbortedError): aiohttp does not cancel its handler, and a compile no
        thread has started is dropped once nobody waits for it (GrammarPool)."""
        if req.sampling_params.grammar is None:
            return
        check = asyncio.ensure_future(client.check_grammar(req))
        try:
            await unless_gone(request, check, "the client disconnected while its grammar compiled")
        except InvalidRequestError as e:
            code = None if e.code == "invalid_request_error" else e.code
            raise bad_request(e.message, param=param, code=code or "invalid_value") from None
        finally:
            check.cancel()  # a gone client, or this handler cancelled: its waiter leaves (no-op once done)

    @staticmethod
    def with_bad_words_ids(client: EngineClient, params: SamplingParams) -> SamplingParams:
        """params with its bad_words as token ids (the scheduler has no tokenizer; the gateway has the
        client's); a 400 naming bad_words if they cannot be."""
        try:
            return tokenize_bad_words(params, client.tokenizer)
        except ShoalError as e:
            raise from_shoal_error(e) from None

    @staticmethod
    def validate(client: EngineClient, req: GenerateRequest) -> GenerateRequest:
        if req.sampling_params.bad_words:  # /generate's sampling_params may name them too
            req = msgspec.structs.replace(
                req, sampling_params=GatewayState.with_bad_words_ids(client, req.sampling_params))
        try:
            return client.validate(req)
        except ShoalError as e:
            raise from_shoal_error(e) from None

    def track(self, base_id: str, reqs: list[GenerateRequest]) -> list[str]:
        """Admits the request's choices (429 past --max-concurrent-requests); every track needs its untrack."""
        # One that passed client() before a drain began (its grammar compiling) is not in flight yet, so the
        # drain would neither wait for it nor abort it: refused here instead.
        if self.shutting_down:
            raise ApiError(503, "not ready: the server is shutting down", code="engine_not_ready")
        limit = self.args.max_concurrent_requests
        if limit is not None and self.active + len(reqs) > limit:
            if len(reqs) > limit:
                raise bad_request(f"this request has {len(reqs)} choices; the server runs at most {limit} at once",
                                  param="n")
            self.metrics.refused("concurrent_requests")
            raise ApiError(429, f"the server is at its limit of {limit} concurrent requests; retry shortly",
                           headers={"Retry-After": "1"})
        self.active += len(reqs)
        rids = [r.rid for r in reqs]
        self.inflight.setdefault(base_id, rids)  # a duplicate user rid must not hide the first request
        client = self.current_client()
        for req in reqs:  # the access log's ids; with --enable-log-requests each prompt's line
            self.request_log.received(client, req)
        return rids

    def batch_limit(self) -> int:
        """The most engine requests (prompts x n, or inputs) one HTTP request may make: what the queue takes
        (--max-waiting-requests) and, where set, --max-concurrent-requests. Routes check their prompt count
        against it before encoding any prompt: a 100k-prompt batch is refused without tokenizing it."""
        limit, running = self.admission.max_waiting_requests, self.args.max_concurrent_requests
        return limit if running is None else min(limit, running)

    async def admit(self, client: EngineClient, reqs: list[GenerateRequest]) -> None:
        """429 with Retry-After when the engine's queue could not start these soon (AdmissionController);
        400 for a request that could never fit the queue, which a retry would only repeat."""
        limit = self.admission.max_waiting_requests
        if len(reqs) > limit:
            raise bad_request(f"this request has {len(reqs)} choices (prompts x n); the server queues at most "
                              f"{limit} (--max-waiting-requests): send it in parts", param="prompt")
        refusal = await self.admission.check(client, reqs)
        if refusal is not None:
            self.metrics.refused(refusal.reason)
            raise ApiError(429, refusal.message, code="server_overloaded", headers=refusal.headers())

    def untrack(self, base_id: str, rids: list[str]) -> None:
        for rid in rids:
            self.admission.started(rid)  # one that never got a delta (an error, a disconnect) waits no more
        self.active -= len(rids)
        if self.inflight.get(base_id) is rids:
            del self.inflight[base_id]


STATE_KEY: web.AppKey[GatewayState] = web.AppKey("shoal_gateway_state", GatewayState)
