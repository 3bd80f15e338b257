"""SchedulerHost: one Scheduler running on its own thread over a WorkerClient — what the in-process
Engine and the Ray SchedulerActor both are around the scheduler. It builds the Scheduler from the
worker's WorkerInfo, decides overlap scheduling, starts and stops the thread, reads stats under the
scheduler's lock, and hands every step's output deltas to the owner's sink (on the scheduler thread).

A live weight update (update_weights) does what SGLang's does: new requests wait (held here, in order,
until it is done: SGLang's tokenizer manager blocks them on its model-update lock), the running ones finish
on the old weights (or, with abort_all_requests, are aborted first), then the weights load between two
steps on the scheduler thread, the prefix cache is flushed and the held requests go in.

Sleep (memory_sleep: vLLM's sleep / wake_up, SGLang's release / resume_memory_occupation) is refused while
requests run (SGLang asserts the same), unless abort_all_requests aborts them first; requests arriving while
it goes to sleep wait, then fail with it. While anything is released, new requests fail at once with
EngineAsleepError (the gateway's 503), never waiting, and a weight update needs the weights awake.

Pause (SGLang's /pause_generation, for RL trainers around a weight sync): no step runs until
continue_generation; requests arriving meanwhile are held here and go in, in order, at continue (a second
pause never touches them). The batch in flight is collected first, then by mode: "abort" ends every request
in the scheduler with finish_reason abort (their KV freed), "retract" puts the running ones (and one mid
chunked prefill) back at the head of the waiting queue with their output so far, their own KV freed (the
prefill on continue recomputes it; not counted as retractions), "in_place" leaves them and their KV as they
are. Weight updates run while paused, at once (they do not wait for paused requests to finish). As in SGLang,
a request paused in place keeps the KV it computed with the old weights and continues on it after an update;
SGLang's flush after such an update fails (flush_cache asserts an idle scheduler), so here an update that
would flush is refused (the old weights serve) while a request paused in place holds KV: pause with
retract or abort, or update with flush_cache=false, which keeps that stale KV on purpose.

Health (runtime/managers/step_health.py): a step that met a dead device, or steps that keep failing when a probe
request fails too, make the scheduler unhealthy for good: new requests are refused (EngineUnhealthyError, the
gateway's 503; one validated before ends with code ENGINE_UNHEALTHY, a 503 too) and health() says why (GET
/health's 503); on Ray the SchedulerActor then answers unhealthy and its replica is relaunched. So does a step
that runs past --watchdog-timeout (runtime/managers/step_watchdog.py: a hang raises nothing); its requests end at
once, from the watchdog's thread (step_failure.fail_hung_step). While that step hangs, calls (call: admin ones)
fail at once with EngineUnhealthyError and stats (/metrics) are read without the lock it holds."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

import torch

from runtime.admin_messages import (
    WEIGHTS,
    AdminReply,
    EngineAsleepError,
    ProfileControl,
    SleepControl,
    UpdateProbe,
    pause_control,
)
from runtime.config import ServerArgs
from runtime.engine_client import EngineHealth, EngineUnhealthyError
from runtime.errors import EngineUnavailableError, InvalidRequestError
from runtime.gc_guard import GcGuard
from runtime.managers.pausable_scheduler import PausableScheduler
from runtime.managers.request_validation import RequestLimits
from runtime.managers.worker_client import WorkerClient
from runtime.mem_cache.cache_event_log import CacheEventLog
from runtime.messages import FinishReason, GenerateRequest, RequestOutput, SchedulerStats, WorkerInfo
from runtime.sampling.grammar_compiler import GrammarCompiler

logger = logging.getLogger(__name__)
T = TypeVar("T")
WEIGHT_UPDATE_TIMEOUT_S = 3600.0  # loading a large checkpoint from a slow disk takes minutes


def overlap_wanted(args: ServerArgs, worker: WorkerClient, info: WorkerInfo) -> bool:
    """Overlap pays only where launching returns before the device is done (CUDA); on a CPU the
    forward runs inside launch, so it would only delay each step's stop checks by one step."""
    return not args.disable_overlap_schedule and worker.can_overlap and info.device.startswith("cuda")


def reserve_known_wanted(args: ServerArgs, info: WorkerInfo) -> bool:
    """--reserve-known-output: auto is on for a GPU worker (runtime/managers/retract.py says why)."""
    mode = args.reserve_known_output
    return mode == "on" or (mode == "auto" and info.device.startswith("cuda"))


class SchedulerHost:
    def __init__(self, args: ServerArgs, worker: WorkerClient, info: WorkerInfo, eos_token_ids: frozenset[int],
                 sink: Callable[[list[RequestOutput]], None],
                 decode_text: Callable[[list[int], bool], str] | None,
                 name: str = "shoal-scheduler", grammar: GrammarCompiler | None = None,
                 cache_events: CacheEventLog | None = None):
        self.worker = worker
        self.grammar = grammar
        self.limits = RequestLimits.of(info, speculative=args.speculative_algorithm is not None)
        self.scheduler = PausableScheduler(
            args, worker, max_total_tokens=info.max_total_tokens, max_reqs=info.max_reqs,
            context_len=info.context_len, vocab_size=info.vocab_size, eos_token_ids=eos_token_ids, sink=sink,
            decode_text=decode_text, overlap=overlap_wanted(args, worker, info), cache_events=cache_events,
            reserve_known_output=reserve_known_wanted(args, info),
            grammar=grammar, pooling=info.pooling,
            pad_drafts=info.device.startswith("cuda") and not args.disable_cuda_graph)  # graph-shaped verify steps
        if info.device.startswith("cuda"):  # a sticky-looking CUDA error is fatal only if the device still fails
            self.scheduler.health.device = info.device
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.gc = GcGuard(name)
        self.weight_version = "default"  # /get_model_info's; a successful weight update sets it
        self._updates = 0
        self._updating = threading.Lock()  # one weight update at a time
        self._gate = threading.Lock()
        self._held: list[GenerateRequest] | None = None  # requests arriving during an update, a sleep or a pause
        self._holders = 0  # how many of those hold them now (an update may run while paused)
        self.paused: str | None = None  # the pause mode while paused (SGLang's /pause_generation)
        self._sink = sink
        self.asleep: list[str] = []  # the memory tags released now (empty: awake)

    def start(self) -> None:
        self.gc.start()  # start-up is over: what it left alive stays out of every collection
        self._thread.start()

    def _run(self) -> None:
        self.worker.bind_thread()
        self.scheduler.run_forever(self._stop)

    # ---- any thread -----------------------------------------------------------------------------
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def health(self) -> EngineHealth:
        """The scheduler's StepHealth, or unhealthy when its thread ended without being stopped."""
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stop.is_set():
            return EngineHealth(healthy=False, reason="the scheduler thread ended without being stopped")
        return self.scheduler.health.current()  # waits only while a failed step's errors are being delivered

    def validate(self, req: GenerateRequest) -> GenerateRequest:
        if self.asleep:
            raise EngineAsleepError(self.asleep)
        return self.scheduler.validate(req, self.limits)

    def submit(self, req: GenerateRequest) -> None:
        with self._gate:
            if self._held is not None:
                self._held.append(req)
                return
            if self.asleep:  # validated before the sleep began: it ends now, it must not wait for a wake_up
                self._refuse(req)
                return
            self.scheduler.submit(req)

    def _refuse(self, req: GenerateRequest) -> None:
        self._sink([RequestOutput(rid=req.rid, new_token_ids=[], finished=True,
                                  finish_reason=FinishReason("error", message=str(EngineAsleepError(self.asleep))))])

    def abort(self, rid: str) -> None:
        with self._gate:  # a held request ends here: the scheduler's memory of early aborts is bounded
            for i, req in enumerate(self._held or ()):
                if req.rid == rid:
                    del self._held[i]
                    self._sink([RequestOutput(rid=rid, new_token_ids=[], finished=True, finish_reason=FinishReason(
                        "abort", message="aborted while held (a pause or a weight update)"))])
                    return
        self.scheduler.abort(rid)

    def stats(self, timeout_s: float = 10.0) -> SchedulerStats:
        """Waits for the step in progress: call off event loops. While a step hangs (the watchdog's verdict) it
        answers at once, read without the lock that step holds (racy, but the stuck thread changes nothing):
        /metrics keeps answering."""
        try:
            stats = self.call(self.scheduler.get_stats, timeout_s)
        except EngineUnhealthyError:
            try:
                stats = self.scheduler.get_stats()
            except RuntimeError:  # a dict changed while read: the step returned after all, so calls are answered
                stats = self.call(self.scheduler.get_stats, timeout_s)
        return self._with_gc(stats)

    def call(self, fn: Callable[[], T], timeout_s: float = 10.0, on_thread: bool = False) -> T:
        """fn() on the scheduler thread between two steps, under its lock; waits for it (call off event loops)
        and raises what it raised. A running loop answers through its inbox: waiting for its lock would starve
        while it steps back to back (a Lock is not fair). A loop that does not answer in timeout_s (or is not
        running): fn runs here, under the lock, unless on_thread (fn needs that thread): EngineUnavailableError.
        While a step hangs (the lock and the thread are that step's): EngineUnhealthyError, at once or as soon
        as the watchdog says so (StepWatchdog.refuse_calls), unless fn has begun."""
        watchdog = self.scheduler.watchdog
        if not self.is_running() and on_thread:
            raise EngineUnavailableError("the scheduler is not running")
        watchdog.refuse_calls()
        if self.is_running():
            answer: Future[T] = Future()

            def run() -> None:
                if not answer.set_running_or_notify_cancel():  # the caller gave up and ran fn itself
                    return
                try:
                    answer.set_result(fn())
                except Exception as e:  # the caller's failure, never the scheduler loop's
                    answer.set_exception(e)

            self.scheduler.inbox.put(("call", run))
            try:
                return watchdog.wait(answer, timeout_s)
            except FutureTimeout:
                if not answer.cancel():  # it started meanwhile: its answer is coming
                    return answer.result()
                logger.warning("the scheduler did not answer in %.0f s", timeout_s)
                if on_thread:
                    raise EngineUnavailableError(f"the scheduler did not answer in {timeout_s:.0f} s") from None
        with watchdog.holding(self.scheduler.lock), torch.inference_mode(False):  # as on its thread: the caller's
            return fn()  # mode would make what fn allocates inference tensors, which that thread cannot update

    def flush_cache(self) -> AdminReply:
        """SGLang's /flush_cache, vLLM's /reset_prefix_cache: drops every cached prefix no request uses now."""
        kv = self.scheduler.kv
        return self.call(lambda: AdminReply(flushed_tokens=kv.flush(), kept_tokens=kv.cache.protected_size()))

    def profile(self, ctl: ProfileControl, timeout_s: float = 60.0) -> AdminReply:
        """Starts or stops a trace of every TP rank's steps, between two steps (a stop writes the files)."""
        return self.call(lambda: self.worker.profile(ctl), timeout_s, on_thread=True)

    def update_weights(self, apply: Callable[[], AdminReply], abort_all: bool = False, flush: bool = True,
                       weight_version: str | None = None) -> AdminReply:
        """A live weight update (the module docstring says how requests fare); apply() loads the weights on
        the scheduler thread with nothing running and answers an AdminReply (error: the old weights serve)."""
        with self._updating:  # the check inside: a sleep holding the lock may release the weights meanwhile
            if WEIGHTS in self.asleep:
                return AdminReply(error=self._refusal(flush))
            self._hold()
            try:
                if abort_all:  # SGLang's abort_all_requests: they end with finish_reason abort
                    for rid in self.call(lambda: list(self.scheduler.reqs)):
                        self.scheduler.abort(rid)
                if self.paused is None:  # paused: nothing steps, so the paused requests never finish
                    self._wait_idle()
                reply = self.call(lambda: self._apply_update(apply, flush, weight_version), WEIGHT_UPDATE_TIMEOUT_S,
                                  on_thread=True)
            finally:
                waited = len(self._held or ())
                self._release()
            reply.num_paused_requests = waited
            return reply

    def memory_sleep(self, ctl: SleepControl, apply: Callable[[], AdminReply]) -> AdminReply:
        """Sleep or wake_up (the module docstring says how requests fare); apply() releases or restores the
        memory on every TP rank, on the scheduler thread with nothing running, and answers what stays released."""
        with self._updating:  # never beside a weight update
            if not ctl.sleep:
                return self.call(lambda: self._apply_memory(apply, flush=False), WEIGHT_UPDATE_TIMEOUT_S, on_thread=True)
            self._hold()
            try:
                if ctl.abort_all_requests:
                    for rid in self.call(lambda: list(self.scheduler.reqs)):
                        self.scheduler.abort(rid)
                busy = self.call(lambda: len(self.scheduler.reqs))
                if busy and not ctl.abort_all_requests:
                    reply = AdminReply(error=f"cannot sleep: {busy} requests are running or waiting; let them finish "
                                             "or pass abort_all_requests=true", sleeping_tags=list(self.asleep))
                else:
                    self._wait_idle()
                    reply = self.call(lambda: self._apply_memory(apply, flush=True), WEIGHT_UPDATE_TIMEOUT_S,
                                      on_thread=True)
            finally:
                self._release()
            return reply

    def pause_generation(self, mode: str = "abort") -> AdminReply:
        """SGLang's pause (the module docstring says how requests fare); pausing again applies the new mode to
        what the scheduler holds (never to the requests held here). InvalidRequestError: a bad mode, DP attention."""
        pause_control(mode)
        if self.scheduler.must_step:  # its DP peers would wait in the next collective for a step never taken
            raise InvalidRequestError("pause_generation is not supported with --enable-dp-attention", param="mode")
        with self._updating:  # never inside a weight update, whose wait for running requests needs steps
            with self._gate:
                first, self.paused = self.paused is None, mode
            if first:
                self._hold()
            try:
                n = self.call(lambda: self.scheduler.pause_now(mode), WEIGHT_UPDATE_TIMEOUT_S, on_thread=True)
            except Exception:
                if first:
                    self._unpause()
                raise
            return AdminReply(message=f"paused ({mode}): {n} requests {'aborted' if mode == 'abort' else 'retracted'}"
                              if mode != "in_place" else "paused (in_place)")

    def continue_generation(self) -> AdminReply:
        """SGLang's continue: steps run again, the held requests go in. Without a pause it does nothing."""
        with self._updating:
            if self.paused is None:
                return AdminReply(message="not paused")
            self._unpause()
            return AdminReply(message="continued")

    def _unpause(self) -> None:
        def resume() -> None:
            self.scheduler.paused = False

        try:
            self.call(resume)  # not on_thread: a stopped loop's flag is cleared here
        finally:  # a step that hangs refuses the call: the held requests end (Scheduler.submit), never wait on
            self.paused = None
            self._release()  # after the flag: the held requests queue behind the paused ones

    def _hold(self) -> None:
        with self._gate:
            self._holders += 1
            if self._held is None:
                self._held = []

    def _release(self) -> None:
        """One holder less; with none left the held requests go in, in order (refused while asleep)."""
        with self._gate:
            self._holders -= 1
            if self._holders or self._held is None:
                return
            held, self._held = self._held, None
            for req in held:
                self._refuse(req) if self.asleep else self.scheduler.submit(req)

    def _apply_memory(self, apply: Callable[[], AdminReply], flush: bool) -> AdminReply:
        if flush:  # every slot free (nothing runs): the KV pool is released as an empty one
            self.scheduler.kv.flush()
        reply = apply()
        self.asleep = list(reply.sleeping_tags)
        return reply

    def _wait_idle(self) -> None:
        """Until every request admitted before the update has finished (and no batch is in flight)."""
        sched = self.scheduler
        while not self.call(lambda: not sched.reqs and sched.pending is None, WEIGHT_UPDATE_TIMEOUT_S, on_thread=True):
            time.sleep(0.005)

    def check_update(self, probe: UpdateProbe) -> AdminReply:
        """Would a weight update be taken now? Holds and loads nothing: a client over several replicas asks each
        first and refuses the update on all if one would (RayAdminClient); update_weights checks again."""
        return AdminReply(error=self.call(lambda: self._refusal(probe.flush_cache, probe.abort_all_requests)))

    def _refusal(self, flush: bool, abort_all: bool = False) -> str | None:
        """Why an update would be refused now (None: it would load); on the scheduler thread (requests' KV)."""
        if WEIGHTS in self.asleep:
            return ("the weights are asleep (released by sleep / release_memory_occupation): wake_up with tags "
                    "weights before updating them")
        # SGLang's flush asserts after the load: refused before it. abort_all: the aborts free that KV first.
        stale = self.scheduler.holds_kv() if flush and not abort_all and self.paused is not None else 0
        return None if not stale else (f"{stale} requests paused in place hold KV computed with the current weights, "
                                       "which a flush cannot drop: pause with mode retract or abort, or pass "
                                       "flush_cache=false to keep that KV (it goes stale) and the prefix cache")

    def _apply_update(self, apply: Callable[[], AdminReply], flush: bool, weight_version: str | None) -> AdminReply:
        refusal = self._refusal(flush)  # again at load time (RayAdminClient says why a change since is harmless)
        reply = apply() if refusal is None else AdminReply(error=refusal)
        if reply.error is None:
            self._updates += 1
            self.weight_version = weight_version or f"update-{self._updates}"
            reply.weight_version = self.weight_version
            if flush:  # the cached prefixes' KV came from the old weights
                reply.flushed_tokens = self.scheduler.kv.flush()
        return reply

    def _with_gc(self, stats: SchedulerStats) -> SchedulerStats:
        stats.gc_pause_s, stats.gc_slow_pauses = self.gc.pauses.total_s, self.gc.pauses.slow
        stats.paused_replicas = int(self.paused is not None)  # /health_generate answers it without a probe
        return stats

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stops the loop after its current step; True when the thread has ended."""
        self._stop.set()
        self.gc.stop()
        if self.grammar is not None:
            self.grammar.shutdown()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def request_stop(self) -> None:
        """Stops the loop without waiting (from a failure callback that may run on the loop itself)."""
        self._stop.set()

    def unstarted_rids(self) -> list[str]:
        """Once the loop has ended: rids still in its inbox or held here, which nobody will ever answer."""
        if self._thread.is_alive():
            return []
        with self._gate:
            rids = [req.rid for req in self._held or ()]
            if self._held:
                self._held.clear()
        while True:
            try:
                kind, item = self.scheduler.inbox.get_nowait()
            except queue.Empty:
                return rids
            if kind == "add":
                rids.append(item.rid)
