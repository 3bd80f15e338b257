"""SchedulerActor: one replica's scheduler — or one DP-attention rank's — as an async Ray actor that is
also TP rank 0: it holds that rank's GPU and TpWorker in its own process, so a step is a local call,
overlap scheduling works as in the in-process Engine (the same SchedulerHost), and the other ranks
(TpWorkerActors) follow each step over a StepChannel (BroadcastWorker).

Requests and outputs travel over each client's direct link (LinkServer: two TCP connections, no Ray
call per request or per step); a step's deltas for one client go out as one pushed frame however many
requests stream. A client without a link (--disable-request-link) calls `submit()` and long-polls
`poll()` instead, which returns the same answer: every delta for that consumer since its last poll.

A watcher task awaits the other ranks' follow loops: a rank that dies or fails ends the replica's
requests with an error naming it, and every later answer says unhealthy (the client then relaunches the
replica), unless stop() said the group is being killed on purpose. So does a scheduler whose steps keep
failing or met a dead device (StepHealth), or whose step hangs past --watchdog-timeout, with its reason.
The requests of the step that failed (or hangs) end with its error; those a failed replica never ran end
with a FinishReason code (ENGINE_UNHEALTHY, REPLICA_FAILED) that has the client move them
(runtime/managers/step_failure.py). Those ends are in the answer that first says unhealthy: the scheduler
publishes its verdict while it delivers them to _sink, and reading the health waits for that delivery."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

from runtime.admin_messages import (
    AdminReply,
    PauseControl,
    ProfileControl,
    SleepControl,
    UpdateProbe,
    WeightUpdate,
)
from runtime.cluster.replica_ranks import ReplicaRanks
from runtime.cluster.tp_rank import RankSpec, TpRank, endpoint, local_model_path
from runtime.cluster.weight_sync_actor import WeightSyncRanks
from runtime.config import ServerArgs
from runtime.engine_client import ENGINE_UNHEALTHY, REPLICA_FAILED
from runtime.errors import EngineUnavailableError, InvalidRequestError
from runtime.logging_setup import setup_logging
from runtime.lora.lora_config import LoraNotFoundError
from runtime.messages import (
    FinishReason,
    GenerateRequest,
    LoraLoad,
    LoraUpdate,
    OutputPoll,
    RequestOutput,
    SchedulerStats,
    WorkerInfo,
)

logger = logging.getLogger(__name__)


class SchedulerActor(ReplicaRanks):  # the weight loads and sleeps of all its TP ranks
    def __init__(self, args: ServerArgs, model_path: str, spec: RankSpec):
        setup_logging(args.log_level)  # an actor's own process: the server's level, timestamps, logger names
        self.args, self.model_path, self.spec = args, model_path, spec
        self.name = f"rank {spec.rank}"
        self.rank: TpRank | None = None
        self.host: Any = None  # SchedulerHost, once started
        self.group: Any = None  # BroadcastWorker when other ranks follow this one
        self.failed: EngineUnavailableError | None = None
        self.stopping = False  # the group is being killed on purpose (stop()): a follower's death is no failure
        self._followers: list[Any] = []
        self._watcher: asyncio.Future | None = None
        self._lock = threading.Lock()
        self._owner: dict[str, str] = {}  # rid → consumer that submitted it
        self._pending: dict[str, list[RequestOutput]] = {}  # consumer → deltas not yet polled
        self._wakeups: dict[str, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.cache_events: Any = None  # CacheEventLog: what the prefix cache holds, for cache-aware routing
        self.links: Any = None  # LinkServer, once started

    # ---- start-up (called by the launcher, in this order) -----------------------------------------
    def endpoint(self) -> tuple[str, int]:
        return endpoint()

    def init(self, master_addr: str, master_port: int) -> WorkerInfo:
        self.model_path = local_model_path(self.args, self.model_path)
        self.rank = TpRank.join(self.args, self.model_path, self.spec, master_addr, master_port)
        return self.rank.worker.info()

    async def start(self, name: str, followers: list[Any]) -> str:
        """Starts the scheduler (and the followers' loops): the replica serves from here on."""
        from runtime.cluster.broadcast_worker import BroadcastWorker
        from runtime.cluster.link_server import LinkServer
        from runtime.managers.scheduler_host import SchedulerHost
        from runtime.mem_cache.cache_event_log import CacheEventLog
        from runtime.text.tokenizer import Tokenizer

        self.name, self._followers = name, list(followers)
        self._loop = asyncio.get_running_loop()
        worker = self.rank.worker
        info = worker.info()
        tokenizer = Tokenizer(self.args.tokenizer_path or self.model_path, tuple(info.eos_token_ids))
        if self.rank.channel is not None:
            self.group = worker = BroadcastWorker(worker, self.rank.channel, name, self._on_group_failure)
        from runtime.sampling.grammar_compiler import create_grammar_compiler

        grammar = create_grammar_compiler(tokenizer, info.vocab_size, self.args.grammar_compile_timeout_s)
        if self.args.routing_policy == "cache_aware" and self.args.radix_cache_enabled and self.args.dp_size > 1:
            self.cache_events = CacheEventLog()
        self.links = LinkServer(endpoint()[0], name, submit=self._submit, abort=self._host_abort, answer=self._answer,
                                gone=self._forget)
        self.host = SchedulerHost(self.args, worker, info, tokenizer.eos_token_ids, self._sink,
                                  tokenizer.decode, name=f"shoal-scheduler-{name}", grammar=grammar,
                                  cache_events=self.cache_events)
        if self._followers:
            self._watcher = asyncio.ensure_future(self._watch([f.serve.remote() for f in self._followers]))
        self.host.start()
        return name

    # ---- scheduler thread → consumers -----------------------------------------------------------
    def _sink(self, outputs: list[RequestOutput]) -> None:
        touched: set[str] = set()
        now = time.perf_counter()
        with self._lock:
            for o in outputs:
                if o.trace is not None:
                    o.trace.queued = now
                consumer = self._owner.pop(o.rid, None) if o.finished else self._owner.get(o.rid)
                if consumer is not None:
                    self._pending.setdefault(consumer, []).append(o)
                    touched.add(consumer)
        self._wake(touched)

    def _wake(self, consumers: set[str]) -> None:
        loop = self._loop
        for c in consumers:
            if self.links is not None and self.links.push_now(c):
                continue
            event = self._wakeups.get(c)
            if event is not None and loop is not None:
                loop.call_soon_threadsafe(event.set)

    def _take(self, consumer: str) -> list[RequestOutput]:
        with self._lock:
            return self._pending.pop(consumer, [])

    # ---- actor API ------------------------------------------------------------------------------
    async def ready(self) -> str:
        return self.name

    def healthy(self) -> bool:
        return self.down_reason() is None

    def down_reason(self) -> str | None:
        """Why this replica cannot serve, None while it can: a TP rank failed, the scheduler stopped, or its
        steps keep failing or met a dead device (SchedulerHost.health): the client then relaunches it."""
        if self.failed is not None:
            return str(self.failed)
        if self.host is None or not self.host.is_running():
            return f"{self.name}'s scheduler is not running"
        return self.host.health().reason

    def link_address(self) -> tuple[str, int]:
        """Where clients open their links (LinkServer)."""
        return self.links.address

    async def submit(self, req: GenerateRequest, consumer: str) -> None:
        """The request must have passed validation (RayEngineClient.validate)."""
        self._submit(req, consumer)

    def _submit(self, req: GenerateRequest, consumer: str) -> None:
        """Any thread (the event loop, or a link's reader)."""
        if not self.healthy():
            self._error_out([req.rid], consumer)
            return
        with self._lock:
            self._owner[req.rid] = consumer
        self.host.submit(req)

    async def abort(self, rid: str) -> None:
        self._host_abort(rid)

    def _host_abort(self, rid: str) -> None:
        if self.host is not None:
            self.host.abort(rid)

    def _forget(self, consumer: str) -> None:
        """A client's link closed: nobody reads its requests' outputs any more, so end them."""
        with self._lock:
            rids = [rid for rid, c in self._owner.items() if c == consumer]
            self._pending.pop(consumer, None)
        for rid in rids:
            self._host_abort(rid)

    async def poll(self, consumer: str, timeout_s: float = 1.0, cache_seq: int | None = None) -> bytes:
        """Deltas for `consumer`'s requests; waits up to timeout_s for the first one. cache_seq: also the
        prefix cache's changes since that log position (-1: a snapshot). An encoded OutputPoll."""
        event = self._wakeups.setdefault(consumer, asyncio.Event())
        outputs = self._take(consumer)
        if not outputs and self.healthy():
            event.clear()
            outputs = self._take(consumer)  # a delta may have landed between the take and the clear
            if not outputs:
                try:
                    await asyncio.wait_for(event.wait(), timeout_s)
                except asyncio.TimeoutError:
                    pass
                outputs = self._take(consumer)
        return self._answer(consumer, cache_seq, outputs).encode()

    def _answer(self, consumer: str, cache_seq: int | None, outputs: list[RequestOutput] | None = None) -> OutputPoll:
        """Any thread: the consumer's deltas (those given, or all pending), health, and cache changes."""
        if outputs is None:
            outputs = self._take(consumer)
        error = self.down_reason()
        healthy = error is None
        if not healthy:
            self._fail_unstarted()
            outputs += self._take(consumer)
        # Read after the outputs: a finished request's prefix is in the log before its last delta.
        cache = self.cache_events.since(cache_seq) if cache_seq is not None and self.cache_events else None
        now = time.perf_counter()
        for o in outputs:
            if o.trace is not None:
                o.trace.polled = now
        return OutputPoll(outputs=outputs, healthy=healthy, error=error, cache=cache)

    async def stats(self) -> SchedulerStats:
        return await asyncio.to_thread(self.host.stats)  # waits for the step in progress: off the loop

    async def health(self) -> bool:
        return self.healthy()

    async def stop(self) -> None:
        """Its group is about to be killed (a shutdown, a relaunch): the followers may die before this actor."""
        self.stopping = True

    # ---- operator calls (runtime/cluster/ray_admin_client.py) -------------------------------------
    async def flush_cache(self) -> AdminReply:
        """Drops every prefix-cache entry no running request uses, between two steps."""
        return await asyncio.to_thread(_admin, self.host.flush_cache)

    async def profile(self, ctl: ProfileControl) -> AdminReply:
        """Starts or stops the trace of this replica's steps, on every TP rank (BroadcastWorker.profile)."""
        return await asyncio.to_thread(_admin, lambda: self.host.profile(ctl))

    async def update_weights_from_disk(self, update: WeightUpdate) -> AdminReply:
        """A live weight update of this replica (SchedulerHost.update_weights: new requests wait, running ones
        finish or are aborted), loaded by every TP rank: all check, then all load."""
        return await asyncio.to_thread(_admin, lambda: self.host.update_weights(
            lambda: self._update_all_ranks(update), update.abort_all_requests, update.flush_cache,
            update.weight_version))

    async def check_update(self, probe: UpdateProbe) -> AdminReply:
        """Would this replica take a weight update now (SchedulerHost.check_update)? Holds and loads nothing:
        the client asks every replica before any loads."""
        return await asyncio.to_thread(_admin, lambda: self.host.check_update(probe))

    async def pause_generation(self, ctl: PauseControl) -> AdminReply:
        """SchedulerHost.pause_generation: no step runs here until continue_generation; new requests wait."""
        return await asyncio.to_thread(_admin, lambda: self.host.pause_generation(ctl.mode))

    async def continue_generation(self) -> AdminReply:
        return await asyncio.to_thread(_admin, self.host.continue_generation)

    async def weight_version(self) -> str:
        return self.host.weight_version if self.host is not None else "default"

    async def weight_sync(self, method: str, arg: Any) -> AdminReply:
        """init_ / destroy_weights_update_group, update_weights_from_distributed on every TP rank at once
        (WeightSyncRanks: a failed join or an update refused before receiving leaves no rank in the group)."""
        return await asyncio.to_thread(_admin, lambda: WeightSyncRanks(self).call(method, arg))

    async def memory_sleep(self, ctl: SleepControl) -> AdminReply:
        """Sleep or wake_up of this replica (SchedulerHost.memory_sleep: refused while requests run unless
        ctl.abort_all_requests), on every TP rank at once."""
        return await asyncio.to_thread(_admin, lambda: self.host.memory_sleep(ctl, lambda: self._memory_all_ranks(ctl)))

    async def sleeping_tags(self) -> list[str]:
        return list(self.host.asleep) if self.host is not None else []

    # ---- LoRA adapters at run time (runtime/lora/lora_registry.py) --------------------------------
    async def load_lora_adapter(self, name: str, path: str, replace: bool = False) -> LoraUpdate:
        """Every TP rank of this replica reads the adapter (this one, then the followers) before the
        scheduler lets a request name it. Off the loop: it reads files and waits for the followers."""
        registry = self.host.scheduler.lora_ids
        return await asyncio.to_thread(_lora_update, lambda: registry.load(name, path, self._add_lora, replace))

    async def unload_lora_adapter(self, name: str) -> LoraUpdate:
        registry = self.host.scheduler.lora_ids
        return await asyncio.to_thread(_lora_update, lambda: registry.unload(name))

    def _add_lora(self, load: LoraLoad) -> None:
        self.rank.worker.add_lora(load)
        if self._followers:  # a rank that cannot read it fails the load; the registry has all ranks forget it
            import ray

            errors = [a.error for a in ray.get([f.add_lora.remote(load) for f in self._followers]) if a.error]
            if errors:
                raise InvalidRequestError(errors[0], param="lora_path")

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        """This actor's OS process (chaos tests SIGKILL it)."""
        return os.getpid()

    # ---- failure --------------------------------------------------------------------------------
    async def _watch(self, loops: list[Any]) -> None:
        """Awaits the followers' loops (ObjectRefs of serve(), rank 1 first) on the actor's event loop -- a blocking
        ray.get here would warn and hold the loop: the first to end, outside a stop(), is a failed replica."""
        from runtime.cluster.broadcast_worker import describe_exception

        ends = [asyncio.ensure_future(ref) for ref in loops]
        done, pending = await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        for end in pending:
            end.cancel()
        rank, end = next((r, e) for r, e in enumerate(ends, 1) if e in done)
        error = end.exception()
        reason = "its step loop ended" if error is None else describe_exception(error)
        if not self.stopping and self.host is not None and self.host.is_running():
            self.group.fail(f"TP worker rank {rank} of {self.name} failed: {reason}")

    def _on_group_failure(self, error: EngineUnavailableError) -> None:
        """Any thread: stop the scheduler, and kill the peers so none stays blocked in a collective."""
        import ray

        self.failed = error
        self.host.request_stop()
        if self.links is not None:
            self.links.wake_all()  # each client hears of it now, not at the next heartbeat
        for f in self._followers:
            try:
                ray.kill(f, no_restart=True)
            except Exception:
                logger.debug("ray.kill failed", exc_info=True)

    def _fail_unstarted(self) -> None:
        """After the scheduler thread stopped, requests still in its inbox would never be answered."""
        rids = self.host.unstarted_rids() if self.host is not None else []
        with self._lock:
            owners = {rid: self._owner.pop(rid, None) for rid in rids}
        for rid, consumer in owners.items():
            if consumer is not None:
                self._error_out([rid], consumer)

    def _error_out(self, rids: list[str], consumer: str) -> None:
        """Ends requests this replica never ran: its client moves them to a healthy replica (their FinishReason
        code says whose failure it is: its steps' health, or the replica itself)."""
        message = self.down_reason() or f"{self.name} is not serving"
        lost = self.failed is not None or self.host is None or not self.host.is_running()
        reason = FinishReason("error", message=message, code=REPLICA_FAILED if lost else ENGINE_UNHEALTHY)
        with self._lock:
            self._pending.setdefault(consumer, []).extend(
                RequestOutput(rid=rid, new_token_ids=[], finished=True, finish_reason=reason) for rid in rids)
        self._wake({consumer})


def _lora_update(update: Any) -> LoraUpdate:
    """A load's or unload's outcome as the typed answer that crosses to the client (no exception pickling)."""
    try:
        update()
    except LoraNotFoundError as e:
        return LoraUpdate(error=e.message, not_found=True)
    except InvalidRequestError as e:
        return LoraUpdate(error=e.message)
    return LoraUpdate()


def _admin(call: Any) -> AdminReply:
    """An operator call's answer as the typed reply that crosses to the client (no exception pickling)."""
    try:
        return call()
    except (InvalidRequestError, EngineUnavailableError) as e:
        return AdminReply(error=str(e))
