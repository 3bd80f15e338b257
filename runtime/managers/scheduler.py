"""Scheduler: continuous batching for one data-parallel replica. Each step: take new requests and aborts from the
inbox, pick the next batch (prefill first under the token budget, chunked; else the running decodes; both at
once when MIXED is on; IDLE when a DP rank must step with nothing to do), allocate KV (evicting cache, then
retracting), run it on the TP workers, then append tokens, check stops and free or cache what finished."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable

from runtime.config import ServerArgs
from runtime.engine_client import ENGINE_UNHEALTHY, EngineUnhealthyError
from runtime.errors import EngineUnavailableError, InvalidRequestError
from runtime.lora.lora_registry import LoraRegistry
from runtime.managers.decode_batch import prepare_decode
from runtime.managers.grammar_manager import GrammarManager
from runtime.managers.kv_cache_manager import KVCacheManager
from runtime.managers.prefill import PrefillAdder
from runtime.managers.req import Req, ReqState
from runtime.managers.request_validation import RequestLimits, validate_request
from runtime.managers.retract import Retractor
from runtime.managers.rid_ledger import RidLedger
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.managers.scheduler_stats import scheduler_stats
from runtime.managers.spec_decoding import SpecDecoding
from runtime.managers.stats import ForwardModeStats
from runtime.managers.step_failure import fail_hung_step, fail_step
from runtime.managers.step_health import StepHealth
from runtime.managers.step_watchdog import StepWatchdog
from runtime.managers.token_intake import TokenIntake
from runtime.managers.worker_client import WorkerClient
from runtime.mem_cache.cache_event_log import CacheEventLog
from runtime.messages import BatchResult, FinishReason, GenerateRequest, RequestOutput, SchedulerStats
from runtime.model_executor.forward_mode import ForwardMode
from runtime.sampling.grammar_compiler import GrammarCompiler
from runtime.text.embedding_request import check_task

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, args: ServerArgs, worker: WorkerClient, *, max_total_tokens: int, max_reqs: int,
                 context_len: int, vocab_size: int, eos_token_ids: frozenset[int],
                 sink: Callable[[list[RequestOutput]], None],
                 decode_text: Callable[[list[int], bool], str] | None = None,
                 overlap: bool = False, cache_events: CacheEventLog | None = None, pad_drafts: bool = False,
                 grammar: GrammarCompiler | None = None, reserve_known_output: bool = False,
                 pooling: str | None = None):
        self.args, self.worker, self.sink, self.decode_text = args, worker, sink, decode_text
        self.context_len, self.vocab_size, self.eos_token_ids = context_len, vocab_size, eos_token_ids
        self.max_running = min(args.max_running_requests, max_reqs - 1)
        self.lora_ids = LoraRegistry(args)  # --enable-lora: adapter name → id, loaded / unloaded at run time
        cache_on = args.prefix_cache_for(pooling)  # an embedding server's only with last-token pooling
        self.kv = KVCacheManager(max_total_tokens, max_reqs, context_len, enable_cache=cache_on,
                                 cache_events=cache_events, loras=self.lora_ids.slots)
        self.limits = RequestLimits(context_len, vocab_size, self.kv.size, args.speculative_algorithm is not None, args.priority_scheduling)
        self.retractor = Retractor(args, reserve_known_output)
        self.prefill = PrefillAdder(args, self.kv, self.retractor, cache_on)
        self.priority = self.prefill.priority  # None: without priority scheduling (every priority is 0)
        self.stats = ForwardModeStats(args.log_interval_s)
        self.intake = TokenIntake(self.kv, self.stats, context_len, decode_text)
        self.spec = (SpecDecoding(args, self.kv, self.stats, context_len, pad_drafts)
                     if args.speculative_algorithm else None)
        self.grammars = GrammarManager(grammar, vocab_size)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.rids = RidLedger()  # aborts that overtook their request; rids that ended lately
        self.lock = threading.Lock()  # held for a whole step; readers of the state take it too
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.reqs: dict[str, Req] = {}
        self.rng = random.Random(args.random_seed)
        self.batch_id = 0
        self.must_step = args.enable_dp_attention  # step (IDLE) even with no work of our own
        # Overlap scheduling: launch batch N+1 before collecting batch N, so the device never waits for
        # the CPU. Only where the worker runs asynchronously; DP attention keeps ranks in lockstep.
        # Speculative steps need the accepted tokens before drafting the next; an embedding server's
        # requests end with their prefill (nothing to overlap): no overlap with either.
        self.overlap = (overlap and worker.can_overlap and not self.must_step and self.spec is None
                        and not args.is_embedding)
        self.pending: tuple[ScheduleBatch, object] | None = None
        self._defer_grammar = getattr(worker, "can_defer_sampling", False)
        self.health = StepHealth()  # failing steps, a dead device: unhealthy (GET /health 503), new requests refused
        # A step that never returns: unhealthy too, its requests ended from the watchdog's thread
        self.watchdog = StepWatchdog(args.watchdog_timeout, self.health,
                                     lambda reason, started: fail_hung_step(self, reason, started))
        self.stepping: list[ScheduleBatch] = []  # the step's batch and the one in flight: whose failure (fail_step)
        self.undelivered: list[RequestOutput] = []  # ends fail_step holds through its probe (the watchdog's, too)
        self.gen_throughput = 0.0
        self.device_busy_s = 0.0
        self._busy_since: float | None = None  # wall clock of the last result while steps run back to back

    # ---- requests in ----------------------------------------------------------------------------
    def validate(self, req: GenerateRequest, limits: RequestLimits | None = None) -> GenerateRequest:
        self.health.check()  # unhealthy: EngineUnhealthyError (a 503) before it waits for a step that fails
        self.lora_ids.id_of(req.lora_name)  # any thread; an unserved adapter: a 400 naming model
        return validate_request((limits or self.limits).with_priority(self.limits.priority_scheduling), req)

    def submit(self, req: GenerateRequest) -> None:
        """Thread-safe. The request must have passed validate()."""
        self.inbox.put(("add", req))
        # Read after the put: the watchdog flags the hang before it drains the inbox (step_failure.fail_hung_step).
        # Validated before its verdict, maybe put after its drain: nobody may ever take it (should the step return
        # after all, the thread refuses it too: the sinks drop a second end)
        if self.watchdog.stuck():
            self.sink([RequestOutput(rid=req.rid, new_token_ids=[], finished=True, finish_reason=FinishReason(
                "error", message=f"the engine is unhealthy: {self.watchdog.hung}", code=ENGINE_UNHEALTHY))])

    def abort(self, rid: str) -> None:
        """Thread-safe; unknown or finished rids are ignored."""
        self.inbox.put(("abort", rid))

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(message)

    def _handle(self, message: tuple[str, object]) -> None:
        kind, item = message
        if kind == "add":
            self._add(item)
        elif kind == "abort":
            self._abort(item)
        elif kind == "call":  # run between steps: a busy loop never starves the asker (SchedulerHost.call)
            item()

    def _add(self, g: GenerateRequest) -> None:
        if g.rid in self.reqs:
            self.sink([RequestOutput(rid=g.rid, new_token_ids=[], finished=True, finish_reason=FinishReason(
                "error", message=f"duplicate request id {g.rid!r}"))])
            return
        try:  # again: a caller that skipped validate() must fail alone, not the batch it would join
            g = self.validate(check_task(self.args.is_embedding, g))
            lora_id = self.lora_ids.enter(g.rid, g.lora_name)  # its adapter, held until _finish
        except (InvalidRequestError, EngineUnavailableError) as e:  # the latter: the engine turned unhealthy
            self.rids.refused(g.rid)
            why = f"invalid request ({e.param}): {e.message}" if isinstance(e, InvalidRequestError) else str(e)
            code = ENGINE_UNHEALTHY if isinstance(e, EngineUnhealthyError) else None  # never ran: a 503, moved on Ray
            self.sink([RequestOutput(rid=g.rid, new_token_ids=[], finished=True,
                                     finish_reason=FinishReason("error", message=why, code=code))])
            return
        p = g.sampling_params
        seed = p.seed if p.seed is not None else self.rng.getrandbits(62)
        req = Req(g.rid, g.input_ids, p, seed, self.eos_token_ids, g.return_input_logprob, g.arrival_time, embed=g.embed,
                  input_top_logprobs_num=g.input_top_logprobs_num, lora_id=lora_id, priority=g.priority, cache_salt=g.cache_salt)
        if g.resumed_output_ids:
            req.resume(g.resumed_output_ids)
        self.reqs[g.rid] = req
        if self.rids.arrived(g.rid):
            req.abort()
            self._finish(req)
            return
        if self.grammars.admit(req):
            self.waiting.append(req)
        elif req.finished:
            self._finish(req)

    def _abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None:
            self.rids.abort_unknown(rid)
            return
        req.abort()
        if req in self.waiting:
            self.waiting.remove(req)
        self.grammars.drop(req)
        self._finish(req)

    # ---- the loop -------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self.grammars.compiling)

    def run_forever(self, stop: threading.Event) -> None:
        with self.watchdog.watching():  # its own thread times each step (step_watchdog.py)
            self._loop(stop)

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                stepped = self.step()
                self.watchdog.started = None  # the step is over: waiting for work, and calls, are no step
                if stepped:
                    self.health.succeeded()
                    continue
                try:  # wait for work; DP ranks poll fast since their peers block on our collective
                    fast = self.must_step or self.grammars.compiling  # compiles finish without a message
                    item = self.inbox.get(timeout=0.002 if fast else 0.05)
                except queue.Empty:
                    continue
                with self.lock:  # handled at once, so messages keep their order
                    self.stepping = []
                    self._handle(item)
            except Exception as e:  # never lose requests silently: fail what is in flight, keep serving
                logger.exception("scheduler step failed")
                with self.lock:
                    fail_step(self, e)  # and judge health: unhealthy (for good), or a probe first (still timed)
                self.watchdog.started = None

    def step(self) -> bool:
        with self.lock:
            self.stepping = [self.pending[0]] if self.pending is not None else []
            self._drain_inbox()  # calls run here, untimed: a weight update takes minutes
            self.watchdog.started = time.monotonic()  # the step's clock; run_forever stops it
            self._poll_grammars()
            if self.pending is not None and self._must_flush():
                self._collect_pending()
            batch = self.get_next_batch_to_run()
            if batch is not None and batch.forward_mode.is_idle():  # no overlap with DP attention: nothing pending
                # Untimed: it waits in a collective for its DP peers, one of which may be in a call between steps
                self.watchdog.started = None
            if batch is None:
                if self.pending is not None:
                    self._collect_pending()
                    return True
                self.retractor.on_idle()
                self._busy_since = None
                return False
            self._busy_since = self._busy_since or time.perf_counter()
            self.stepping.append(batch)
            self.batch_id += 1
            wb = batch.to_worker_batch(self.batch_id, embed=self.args.is_embedding, loras=self.kv.loras)
            # Overlap with grammars: the forward goes first; the masks are filled while it runs (after
            # collecting the batch in flight, whose tokens they need). Without deferred sampling,
            # _must_flush collected it.
            defer = self.overlap and self._defer_grammar and self.grammars.constrains(batch)
            if not defer:
                self.grammars.attach_bitmask(batch, wb)
            if not self.overlap:
                result = self.worker.run_batch(wb)
                if result.all_idle:
                    return False
                self.process_batch_result(batch, result)
                return True
            launched = self.worker.launch_batch(wb, sample_later=True) if defer else self.worker.launch_batch(wb)
            for i, r in enumerate(batch.reqs):
                if i >= batch.num_extend or batch.completes_prefill[i]:
                    r.pending_tokens += 1
            previous, self.pending = self.pending, (batch, launched)
            if previous is not None:
                self._collect(*previous)
            if defer:
                self.worker.sample_deferred(launched, *self.grammars.batch_bitmask(batch))
            return True

    def _poll_grammars(self) -> None:
        ready, failed = self.grammars.poll()
        self.waiting.extend(ready)
        for r in failed:
            self._finish(r)

    def _inflight_new(self) -> list[Req]:
        """Requests whose prefill finished in the batch in flight: running from the next collect on."""
        if self.pending is None:
            return []
        b = self.pending[0]
        return [r for i, r in enumerate(b.reqs[: b.num_extend]) if b.completes_prefill[i] and not r.finished]

    def _must_flush(self) -> bool:
        """Cases where the next batch needs the real tokens of the one in flight."""
        # A grammar's mask for the next token needs the token in flight (its matcher must advance first).
        return (self.kv.available() < len(self.running) + 1
                or any(r.needs_fresh_tokens for r in self.running)
                or (not self._defer_grammar and self.grammars.constrains(self.pending[0])))

    def _collect_pending(self) -> None:
        previous, self.pending = self.pending, None
        self._collect(*previous)

    def _collect(self, batch: ScheduleBatch, launched: object) -> None:
        result = self.worker.finish_batch(launched)
        for i, r in enumerate(batch.reqs):
            if i >= batch.num_extend or batch.completes_prefill[i]:
                r.pending_tokens -= 1
        self.process_batch_result(batch, result)

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.priority is not None:
            self.priority.preempt(self)
        keep_free = len(self.running) if self.args.enable_mixed_chunk else 0  # a MIXED step's decodes: a slot each
        prefill, self.chunked_req = self.prefill.build(self.waiting, self.running + self._inflight_new(),
                                                       self.chunked_req, self.max_running, keep_free)
        if prefill is not None:
            if self.args.enable_mixed_chunk and self.running:
                decode = prepare_decode(self, in_batch=prefill.reqs)
                if decode is not None and decode.reqs:
                    prefill.reqs += decode.reqs
                    prefill.out_cache_loc += decode.out_cache_loc
                    prefill.forward_mode = ForwardMode.MIXED
            return prefill
        if self.running:
            batch = prepare_decode(self)
            if batch is not None and self.spec is not None:
                self.spec.upgrade(batch)  # TARGET_VERIFY where drafts and KV allow
            return batch
        if self.must_step:
            return ScheduleBatch(ForwardMode.IDLE)
        return None

    def _retract(self, r: Req) -> None:
        """Frees the request's own KV and puts it back at the head of the queue with its tokens."""
        self.kv.release_retracted(r)
        r.reset_for_retract()
        self.waiting.insert(0, r)
        self.stats.retractions += 1

    # ---- results --------------------------------------------------------------------------------
    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        now = time.perf_counter()  # wall time since the last result, scheduling included (admission's rates)
        self.stats.record(batch.forward_mode, batch.num_tokens(), now - (self._busy_since or now))
        self._busy_since = now
        self.device_busy_s += result.device_s
        if result.embeddings is not None:
            stepped = self.intake.take_embeddings(batch, result)
        elif batch.forward_mode.is_target_verify():
            stepped = self.spec.apply(batch, result, lambda r, i: self.intake.append(r, result, i))
        else:
            stepped = self.intake.take(batch, result)
        ranks = TokenIntake.prompt_ranks(batch, result)
        outputs: list[RequestOutput] = []
        for r in stepped:
            if r.finished:
                self._finish(r, emit=False)
            elif r.state is ReqState.PREFILLING:
                r.state = ReqState.DECODING
                self.running.append(r)
            out = r.take_delta(now)
            if out.input_logprobs is not None and ranks:
                out.input_token_ranks = ranks.get(r.rid)
            outputs.append(out)
        if outputs:
            self.sink(outputs)
        if self.stats.due():  # the numbers walk every live request: only when a line is due
            self.gen_throughput = self.stats.log(batch.forward_mode, len(self.running), len(self.waiting),
                                                 self.kv.held_by(self.live_reqs()), self.kv.size,
                                                 self.kv.cache.total_size())

    def _finish(self, r: Req, emit: bool = True, cache: bool = True) -> None:
        """Frees (or caches) the request's KV and forgets it; emits its last delta unless told not to.
        cache=False frees without inserting into the prefix cache (KV a failed step may not have written)."""
        if r in self.running:
            self.running.remove(r)
        if self.chunked_req is r:
            self.chunked_req = None
        if cache:
            self.kv.release_finished(r)
        else:
            self.kv.release_retracted(r)
        r.state = ReqState.FINISHED
        self.lora_ids.leave(r)
        self.stats.finished(r)
        self.reqs.pop(r.rid, None)
        self.rids.finished(r.rid)
        if emit:
            self.sink([r.take_delta()])

    # ---- introspection ------------------------------------------------------------------------------
    def live_reqs(self) -> list[Req]:
        """Requests holding KV: running, mid chunked prefill, or prefilled in a batch still in flight."""
        return [r for r in self.reqs.values() if r.req_pool_idx is not None]

    def check_kv_invariant(self) -> None:
        self.kv.check_invariant(self.live_reqs())

    def get_stats(self) -> SchedulerStats:
        return scheduler_stats(self)
