"""Engine: the whole server in one process, without Ray — a Scheduler driving one in-process TpWorker on
a background thread. The Python API for tests, notebooks and the quick start (embeddings: encode(), in
EngineEmbeddings), and the EngineClient the HTTP gateway uses when tp = dp = 1."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import msgspec
import torch

from runtime.config import ServerArgs
from runtime.default_model import resolve_model
from runtime.engine_admin import EngineAdmin
from runtime.engine_client import EngineHealth
from runtime.errors import EngineUnavailableError, InvalidRequestError, ServerArgsError
from runtime.logging_setup import setup_logging
from runtime.lora.engine_lora import EngineLora
from runtime.lora.lora_config import per_prompt
from runtime.managers.request_validation import as_id_lists
from runtime.managers.scheduler_host import SchedulerHost
from runtime.messages import FinishReason, GenerateRequest, RequestOutput, SchedulerStats
from runtime.model_executor.tp_worker import TpWorker
from runtime.sampling.generation_defaults import GenerationDefaults
from runtime.sampling.grammar_compiler import create_grammar_compiler
from runtime.sampling.params import SamplingParams
from runtime.stream_delivery import deliver, gather_or_cancel, next_output
from runtime.text.bad_words import tokenize_bad_words
from runtime.text.engine_embeddings import EngineEmbeddings
from runtime.text.prompt_args import each_prompt
from runtime.text.result_collector import AsyncResultStream, ResultCollector, collect_result
from runtime.text.tokenizer import NullTokenizer, Tokenizer, load_tokenizer


class Engine(EngineLora, EngineAdmin, EngineEmbeddings):  # an EngineClient; run-time LoRA, operator calls
    # built under a caller's torch.inference_mode() its state (the KV allocator's free map...) would be
    # inference tensors, which the scheduler thread, outside that mode, could not update: every step failed
    @torch.inference_mode(False)
    def __init__(self, model_path: str | None = None, *, server_args: ServerArgs | None = None, **kwargs: Any):
        if server_args is None:
            server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        if server_args.uses_ray:  # silently serving one rank of a tp=2 request would be a wrong answer
            raise ServerArgsError("--tp-size/--dp-size/--use-ray/--address",
                                  "Engine runs one replica of one rank in this process; for tensor or data "
                                  "parallelism over Ray serve with `shoal serve` (or runtime.cluster's "
                                  "create_ray_engine_client)")
        self.args = server_args
        setup_logging(server_args.log_level)
        self.model_path, self.model_name = resolve_model(server_args.model_path, server_args.served_model_name,
                                                          server_args.revision)
        # what requests leave unset (a bad generation_config.json fails here, before the weights load)
        self.generation_defaults = GenerationDefaults.for_server(server_args, self.model_path)
        self.worker = TpWorker(server_args, self.model_path)
        info = self.worker.info()
        self._tokenizer = load_tokenizer(server_args.tokenizer_path or self.model_path, tuple(info.eos_token_ids),
                                         server_args.chat_template, explicit=server_args.tokenizer_path is not None,
                                         revision=server_args.tokenizer_revision or server_args.revision)
        self.context_len = info.context_len
        self.grammar = create_grammar_compiler(self._tokenizer, info.vocab_size, server_args.grammar_compile_timeout_s)
        self.host = SchedulerHost(server_args, self.worker, info, self._tokenizer.eos_token_ids, self._on_outputs,
                                  None if self._tokenizer.is_null else self._tokenizer.decode, grammar=self.grammar)
        self.scheduler = self.host.scheduler
        self._consumers: dict[str, Callable[[RequestOutput], None]] = {}
        # The scheduler thread claims a consumer with a request's final output while a stream closing
        # early on the loop swaps its own for _discard: one lock so the swap never outlives the claim.
        self._consumers_lock = threading.Lock()
        self._ids = itertools.count()
        self.host.start()
        # A script that ends without shutdown() tore the scheduler down mid-step at interpreter exit, and
        # nanobind then printed ~30 lines of "leaked" Triton objects: shut down first.
        atexit.register(self.shutdown)

    # ---- EngineClient ---------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer | NullTokenizer:
        return self._tokenizer

    def is_ready(self) -> bool:
        return self.host.is_running()

    def health(self) -> EngineHealth:
        return self.host.health()  # unhealthy for good once its steps keep failing (runtime/managers/step_health.py)

    def validate(self, req: GenerateRequest) -> GenerateRequest:
        return self.host.validate(self.check_task(req))

    async def check_grammar(self, req: GenerateRequest) -> None:
        key = req.sampling_params.grammar
        if key is not None and self.grammar is not None:
            await self.grammar.check_async(key)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        consumer = _AsyncConsumer(loop, q)
        with self._consumers_lock:  # a second consumer would steal the first one's outputs
            if req.rid in self._consumers:
                raise InvalidRequestError(f"request id {req.rid!r} is already in use", param="rid")
            self._consumers[req.rid] = consumer
        self._check_ready([req.rid])
        self.host.submit(req)
        done = False
        try:
            while not done:
                out = await next_output(q)
                done = out.finished
                yield out
        finally:
            if not done:  # the consumer went away (client disconnect): free the request's KV
                # Keep the rid taken until its final output arrives, so a retry with the same rid can
                # neither receive this request's abort nor start while this one still runs. If that final
                # output was already claimed (it waits unread in q), the request is over: nothing to do.
                self._abandon([req.rid], consumer)

    def abort(self, rid: str) -> Awaitable[None]:
        """Aborts now, called plainly from Python (`engine.abort(rid)`) or awaited as the gateway's
        EngineClient does: an `async def` would do nothing until awaited. Unknown or finished rids are ignored."""
        self.host.abort(rid)
        return _DONE

    async def stats(self) -> SchedulerStats:
        return await asyncio.to_thread(self.get_stats)  # waits for the step in progress: not on the loop

    # ---- Python API -----------------------------------------------------------------------------
    def get_stats(self) -> SchedulerStats:
        return self.host.stats()

    def make_request(self, prompt: str | None = None, input_ids: list[int] | None = None,
                     sampling_params: dict | SamplingParams | None = None, return_input_logprob: bool = False,
                     rid: str | None = None, input_top_logprobs_num: int = 0,
                     lora_name: str | None = None, priority: int = 0, cache_salt: str | None = None) -> GenerateRequest:
        """Tokenizes and validates one request (InvalidRequestError on anything wrong). input_top_logprobs_num
        N > 0: each prompt position after the first also lists its top N tokens (return_input_logprob implied).
        cache_salt: the request shares prefix-cache KV only with requests of the same salt (vLLM's). A dict's unset
        sampling fields take the model's generation_config.json defaults; a SamplingParams is taken as is."""
        sampling_params, n = self._split_n(sampling_params)
        if n > 1:
            raise InvalidRequestError("n > 1 gives several results: pass it to generate()", param="n")
        params = tokenize_bad_words(SamplingParams.from_dict(sampling_params, self.generation_defaults),
                                    self._tokenizer)
        if input_ids is not None and prompt is not None:
            raise InvalidRequestError("give prompt or input_ids, not both", param="input_ids")
        if input_ids is None and not isinstance(prompt, str):
            raise InvalidRequestError("give a prompt string or input_ids", param="prompt")
        input_ids = as_id_lists(input_ids) if input_ids is not None else self._tokenizer.encode(prompt)
        req = self.validate(GenerateRequest(rid=rid or f"engine-{next(self._ids)}-{uuid.uuid4().hex[:8]}",
                                            input_ids=tuple(input_ids), sampling_params=params,
                                            return_input_logprob=return_input_logprob, lora_name=lora_name,
                                            input_top_logprobs_num=input_top_logprobs_num, priority=priority,
                                            cache_salt=cache_salt))
        if params.grammar is not None and self.grammar is not None:  # a bad grammar fails here, not later
            self.grammar.check(params.grammar)
        return req

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_input_logprob: bool = False,
                 input_top_logprobs_num: int = 0, rid: str | list[str] | None = None,
                 lora_name: str | list[str | None] | None = None, priority: int | list[int] = 0,
                 cache_salt: str | list[str | None] | None = None) -> dict | list[dict]:
        """Blocking generation for one prompt or a list (returned in the same order). rid: the request id
        (one per prompt), for `abort(rid)` from another thread; each result carries its own as "rid".
        lora_name: an adapter served (--lora-modules, load_lora_adapter) for every prompt, or one per prompt.
        priority: one for every prompt or one per prompt (--enable-priority-scheduling; else only 0).
        cache_salt: one for every prompt or one per prompt; prefix-cache KV is shared only within a salt
        (None with None), so tenants see nothing of each other's prompts (vLLM's and SGLang's)."""
        reqs, single = self._make_requests(prompt, sampling_params, input_ids, return_input_logprob,
                                           input_top_logprobs_num, rid, lora_name, priority, cache_salt)
        # One queue for the whole call, drained as deltas arrive: per-request queues read in request order
        # let every later request's deltas pile up (1,000 x 1,000 tokens: up to ~2M live objects for every
        # generation-2 collection to walk while the scheduler thread waits). svc workload on an H100: the
        # run's time outside forwards 0.31 -> 0.07 s.
        inbox: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        collectors = {r.rid: ResultCollector(self._tokenizer, r) for r in reqs}
        with self._consumers_lock:  # a caller's rid may be in use by another thread's request
            taken = next((r.rid for r in reqs if r.rid in self._consumers), None)
            if taken is not None:
                raise InvalidRequestError(f"request id {taken!r} is already in use", param="rid")
            for r in reqs:
                self._consumers[r.rid] = inbox.put
        self._check_ready([r.rid for r in reqs])
        pending, submitted = len(reqs), 0
        try:
            for r in reqs:
                self.host.submit(r)
                submitted += 1
            while pending:
                o = inbox.get()
                c = collectors[o.rid]
                c.add(o)
                pending -= c.finished
        finally:
            if pending:  # interrupted (KeyboardInterrupt in a notebook): nobody reads the rest, free their KV
                self._withdraw([r.rid for r in reqs[submitted:]])
                self._abandon([r.rid for r in reqs[:submitted] if not collectors[r.rid].finished], inbox.put)
        results = [collectors[r.rid].result() for r in reqs]
        return results[0] if single else results

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: dict | list[dict] | None = None, *,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             rid: str | list[str] | None = None, priority: int | list[int] = 0,
             cache_salt: str | list[str | None] | None = None) -> dict | list[dict]:
        """generate() over conversations (vLLM's LLM.chat): one list of {"role", "content"} messages, or a
        list of them; each is rendered with the model's chat template (or --chat-template) first."""
        batch = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], (list, tuple))
        conversations = messages if batch else [messages]
        for conversation in conversations:
            if not (isinstance(conversation, (list, tuple)) and conversation and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in conversation)):
                raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} "
                                          "dicts (or a list of such lists)", param="messages")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message continues the last message: set "
                                      "add_generation_prompt=False with it", param="continue_final_message")
        ids = [self._tokenizer.apply_chat_template(list(c), add_generation_prompt, tools, continue_final_message,
                                                   chat_template_kwargs) for c in conversations]
        return self.generate(sampling_params=sampling_params, input_ids=ids if batch else ids[0], rid=rid,
                             priority=priority, cache_salt=cache_salt)

    def _withdraw(self, rids: list[str]) -> None:
        """Frees the rids of requests an interrupt kept from being submitted. No abort: the scheduler would keep
        an unknown rid's abort and end that rid's next use. (An interrupt between a submit and its count leaves
        that request running unread to its end.)"""
        with self._consumers_lock:
            for rid in rids:
                self._consumers.pop(rid, None)

    def _abandon(self, rids: list[str], consumer: Callable[[RequestOutput], None]) -> None:
        """Aborts the requests whose outputs still go to `consumer`, keeping each rid taken (its outputs
        discarded) until its final output, as a stream closed early does."""
        with self._consumers_lock:
            running = [rid for rid in rids if self._consumers.get(rid) == consumer]  # == : bound methods differ by id
            for rid in running:
                self._consumers[rid] = _discard
        for rid in running:
            self.host.abort(rid)

    def async_generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                       input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                       return_input_logprob: bool = False, input_top_logprobs_num: int = 0,
                       rid: str | list[str] | None = None, lora_name: str | list[str | None] | None = None,
                       priority: int | list[int] = 0, cache_salt: str | list[str | None] | None = None
                       ) -> Coroutine[Any, Any, dict | list[dict]] | AsyncResultStream:
        """`await engine.async_generate(...)` gives what generate() gives (a list for a batch or n > 1) and is
        a coroutine (asyncio.create_task takes it); with stream=True, `async for delta in
        engine.async_generate(..., stream=True)` gives one prompt's text deltas as they come. Bad input
        raises here, before anything is queued."""
        reqs, single = self._make_requests(prompt, sampling_params, input_ids, return_input_logprob,
                                           input_top_logprobs_num, rid, lora_name, priority, cache_salt)
        if stream:
            if len(reqs) != 1:
                raise InvalidRequestError("stream=True streams one prompt and one choice (n = 1): call once per "
                                          "prompt, or leave stream out for a batch", param="prompt")
            return AsyncResultStream(self, reqs[0])
        return self._collect_all(reqs, single)

    async def _collect_all(self, reqs: list[GenerateRequest], single: bool) -> dict | list[dict]:
        if len(reqs) == 1:  # Shoal's own exceptions, as they were (no wrapping)
            result = await collect_result(self, reqs[0])
            return result if single else [result]
        return await gather_or_cancel(collect_result(self, r) for r in reqs)

    def _make_requests(self, prompt, sampling_params, input_ids, return_input_logprob, input_top_logprobs_num=0,
                       rid=None, lora_name=None, priority=0, cache_salt=None):
        if prompt is not None and not isinstance(prompt, (str, list, tuple)):
            raise InvalidRequestError(f"prompt must be a string or a list of strings, not {type(prompt).__name__}",
                                      param="prompt")
        if prompt is not None and input_ids is not None:  # one would be dropped silently
            raise InvalidRequestError("give prompt or input_ids, not both", param="input_ids")
        if rid is not None and not (isinstance(rid, str) or (isinstance(rid, (list, tuple))
                                                             and all(isinstance(r, str) for r in rid))):
            raise InvalidRequestError(f"rid must be a string or a list of strings, got {rid!r}", param="rid")
        input_ids = as_id_lists(input_ids) if input_ids is not None else None
        single = isinstance(prompt, str) or (input_ids is not None and bool(input_ids) and isinstance(input_ids[0], int))
        prompts = [prompt] if isinstance(prompt, str) else prompt
        ids = [input_ids] if single and input_ids is not None else input_ids
        n = len(prompts) if prompts is not None else len(ids or [])
        if n == 0:
            raise InvalidRequestError("nothing to generate: give prompt or input_ids", param="prompt")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(params) != n:
            raise InvalidRequestError(f"{len(params)} sampling_params for {n} prompts", param="sampling_params")
        rids = [rid] if isinstance(rid, str) else rid
        if rids is not None and (len(rids) != n or len(set(rids)) != n):
            raise InvalidRequestError(f"rid needs {n} distinct ids, one per prompt", param="rid")
        reqs, priorities, salts = [], each_prompt(priority, n, "priority"), each_prompt(cache_salt, n, "cache_salt")
        for i in range(n):
            p, copies = self._split_n(params[i])
            if rids and copies > 1:  # abort(rid) must stop what rid names: one request, not a family
                raise InvalidRequestError("rid names one request: with n > 1 leave rid out, or send the prompt "
                                          "n times with n rids and seeds", param="rid")
            req = self.make_request(prompts[i] if prompts is not None else None, ids[i] if ids is not None else None,
                                    p, return_input_logprob, rid=rids[i] if rids else None,
                                    input_top_logprobs_num=input_top_logprobs_num, lora_name=per_prompt(lora_name, n)[i],
                                    priority=priorities[i], cache_salt=salts[i])
            reqs.append(req)
            # Choice j samples with seed + j (as the gateway does): the copies differ, reproducibly.
            seed = req.sampling_params.seed
            for j in range(1, copies):
                pj = req.sampling_params if seed is None else msgspec.structs.replace(
                    req.sampling_params, seed=(seed + j) % 2**63)
                reqs.append(msgspec.structs.replace(req, sampling_params=pj, rid=f"{req.rid}-{j}"))
            single = single and copies == 1
        return reqs, single

    def _split_n(self, params: Any) -> tuple[Any, int]:
        """(the params without n, n): n choices of one prompt come back as n results, prompt by prompt
        (SGLang's Engine does the same; vLLM nests them in one RequestOutput)."""
        if not isinstance(params, dict) or "n" not in params:
            return params, 1
        params = dict(params)
        n = params.pop("n")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.args.max_n:
            raise InvalidRequestError(f"n must be an integer in [1, {self.args.max_n}] (--max-n), got {n!r}",
                                      param="n")
        return params, n

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        with self._consumers_lock:
            claimed = [(self._consumers.pop(o.rid, None) if o.finished else self._consumers.get(o.rid), o)
                       for o in outputs]
        to_streams = []
        for cb, o in claimed:
            if isinstance(cb, _AsyncConsumer):
                to_streams.append((cb.loop, cb.queue, o))
            elif cb is not None:
                cb(o)
        deliver(to_streams)

    def _check_ready(self, rids: list[str]) -> None:
        """Called after registering consumers: shutdown sets _stop before ending registered consumers, so a
        request is either refused here or ended by shutdown, never left waiting."""
        if not self.is_ready():
            for rid in rids:
                self._consumers.pop(rid, None)
            raise EngineUnavailableError("the engine is shut down")

    def shutdown(self) -> None:
        atexit.unregister(self.shutdown)  # and no longer keeps this engine alive until exit
        stopped = self.host.stop()
        # The scheduler is gone: whoever still waits on a request would wait forever.
        for rid in list(self._consumers):
            cb = self._consumers.pop(rid, None)
            if cb is None:
                continue
            try:
                cb(RequestOutput(rid=rid, new_token_ids=[], finished=True,
                                 finish_reason=FinishReason("abort", message="the engine shut down")))
            except RuntimeError:  # that stream's event loop is already closed: nobody is waiting
                pass
        if stopped:
            self.worker.release()  # so a next Engine in this process gets the GPU memory

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _Done:
    """An awaitable that is already done (what Engine.abort returns)."""

    __slots__ = ()

    def __await__(self):
        return iter(())


_DONE = _Done()


class _AsyncConsumer:
    """Where one stream's deltas go: a queue read on the consumer's own event loop."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue = loop, queue

    def __call__(self, o: RequestOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, o)


def _discard(o: RequestOutput) -> None:
    """Consumer of a request nobody reads any more (aborted): its last output ends it."""
