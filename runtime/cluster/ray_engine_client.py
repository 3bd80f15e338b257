"""RayEngineClient: the gateway's EngineClient over scheduler replicas running as Ray actors.

It routes each request to a live replica (RoutingPolicy; cache_aware reads each replica's prefix-cache
events, which ride on the output polls), submits it, and receives its deltas through a per-replica
output pump running on the client's own event loop thread (requests and deltas go over a direct link to
each scheduler actor, ReplicaLinks); deltas are handed to each stream's own loop. A health loop pings
every replica and refreshes the loads least_load routes by.

When a replica fails (an actor died, a step failed, a health check timed out) routing skips it, the
whole replica group is relaunched in the background, and each of its in-flight requests moves to a
live replica with the tokens it already streamed (LiveStream): the client's stream goes on where it
stopped. Only when no replica is live does a request end, with an error saying so."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from runtime.cluster.live_stream import LiveStream, pin_seed
from runtime.cluster.ray_admin_client import RayAdminClient
from runtime.cluster.ray_lora_client import RayLoraClient
from runtime.cluster.replica_group import ReplicaGroup, kill_all
from runtime.cluster.replica_health import ReplicaHealth
from runtime.cluster.replica_links import ReplicaLinks
from runtime.cluster.request_link import RequestLink
from runtime.cluster.routing import CacheAware, ReplicaLoad, create_routing_policy
from runtime.config import ServerArgs
from runtime.engine_client import ENGINE_UNHEALTHY, REPLICA_FAILED, EngineClient, RoutingStats
from runtime.errors import EngineUnavailableError, InvalidRequestError
from runtime.managers.request_validation import RequestLimits, validate_request
from runtime.mem_cache.block_hash import page_hashes
from runtime.messages import GenerateRequest, RequestOutput, SchedulerStats
from runtime.sampling.grammar_compiler import create_grammar_compiler
from runtime.stream_delivery import deliver, next_output
from runtime.text.embedding_request import check_task
from runtime.text.pooling_config import PoolingConfig

logger = logging.getLogger(__name__)


class RayEngineClient(ReplicaHealth, RayLoraClient, RayAdminClient, EngineClient):  # health+relaunch, LoRA, admin
    def __init__(self, args: ServerArgs, launcher: Any, groups: list[ReplicaGroup], tokenizer: Any,
                 model_name: str, *, health_interval_s: float = 1.0, health_timeout_s: float = 10.0,
                 owns_ray: bool = False):
        self.args, self.launcher, self.groups = args, launcher, groups
        self.model_name = model_name
        self._tokenizer = tokenizer
        info = groups[0].info
        self.context_len = info.context_len
        self.pooling = PoolingConfig.for_server(args)  # the driver has the model folder (the tokenizer's)
        self._limits = RequestLimits(info.context_len, info.vocab_size, min(g.info.max_total_tokens for g in groups),
                                     args.speculative_algorithm is not None, args.priority_scheduling)
        # The driver compiles each new grammar once too (cached), so a bad one is a 400 before any actor call.
        self._grammar = create_grammar_compiler(tokenizer, info.vocab_size, args.grammar_compile_timeout_s)
        self.policy = create_routing_policy(args.routing_policy, args)
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.owns_ray = owns_ray
        # Routing targets: a replica's scheduler, or each DP-attention rank's.
        self.replicas: list[ReplicaLoad] = []
        self._target_group: list[int] = []
        for g in groups:
            for _ in g.schedulers:
                self.replicas.append(ReplicaLoad(index=len(self.replicas)))
                self._target_group.append(g.index)
        self._streams: dict[str, LiveStream] = {}
        self._route_lock = threading.Lock()  # routing state is touched from consumer loops and the client loop
        self._rng = random.Random()
        self._restarting: set[int] = set()
        self._consumer = f"client-{uuid.uuid4().hex[:12]}"
        self._links = ReplicaLinks(self._consumer, not args.disable_request_link)
        self._closing = False
        self.restarts = self.failovers = self.failover_errors = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="shoal-ray-client", daemon=True)
        self._thread.start()
        self._tasks: set[asyncio.Future] = set()
        self._init_health()
        self._init_loras()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()

    # ---- EngineClient ---------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def is_ready(self) -> bool:
        return not self._closing and self._thread.is_alive() and any(r.alive for r in self.replicas)

    def validate(self, req: GenerateRequest) -> GenerateRequest:
        return validate_request(self._limits, check_task(self.args.is_embedding, self._awake(req)))

    async def check_grammar(self, req: GenerateRequest) -> None:
        key = req.sampling_params.grammar
        if key is not None and self._grammar is not None:
            await self._grammar.check_async(key)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self._closing:
            raise EngineUnavailableError("the engine is shut down")
        if req.rid in self._streams:  # a second stream would take over the first one's outputs
            raise InvalidRequestError(f"request id {req.rid!r} is already in use", param="rid")
        req = pin_seed(req, self._rng)
        hashes = page_hashes(req.input_ids, salt=req.cache_salt) if self.policy.wants_page_hashes else []
        with self._route_lock:
            target = self.policy.pick(req, self.replicas, hashes)
            i = target.index
            st = LiveStream(req, asyncio.get_running_loop(), i, self.groups[self._target_group[i]].generation, hashes)
            self._streams[req.rid] = st
            self._assign(st, target)
        done = False
        try:
            try:
                await self._links.submit(i, self._actor(i), req)
            except Exception as e:  # the actor died between the routing and the call: fail over
                gi = self._target_group[i]
                self._loop.call_soon_threadsafe(self._on_failure, gi, st.generation, self._failure_message(gi, e))
            while not done:
                out = await next_output(st.queue)
                done = out.finished
                yield out
        finally:
            with self._route_lock:
                self._streams.pop(req.rid, None)
                st.finished = True  # closed: nothing moves it any more
                self._release(st)
            if not done:  # the consumer went away: free the request's KV on the replica it runs on now
                try:
                    self._links.abort(st.target, self._actor(st.target), req.rid)
                except Exception:
                    logger.debug("abort of %s failed", req.rid, exc_info=True)

    async def abort(self, rid: str) -> None:
        st = self._streams.get(rid)
        targets = [st.target] if st is not None else [r.index for r in self.replicas if r.alive]
        for i in targets:
            try:
                sent = self._links.abort(i, self._actor(i), rid)
                if sent is not None:
                    await sent
            except Exception:  # a dead replica has already failed the request
                logger.debug("abort of %s on target %d failed", rid, i, exc_info=True)

    async def stats(self) -> SchedulerStats:
        return SchedulerStats.summed([s for s in await self.replica_stats() if s is not None])

    def routing_stats(self) -> RoutingStats:
        policy = self.policy if isinstance(self.policy, CacheAware) else None
        return RoutingStats(failovers=self.failovers, failover_errors=self.failover_errors, restarts=self.restarts,
                            cache_routed=policy.cache_routed if policy else 0,
                            load_routed=policy.load_routed if policy else 0,
                            inflight=[r.inflight for r in self.replicas], alive=[r.alive for r in self.replicas])

    # ---- routing bookkeeping (under _route_lock) ------------------------------------------------
    def _assign(self, st: LiveStream, target: ReplicaLoad) -> None:
        target.inflight += 1
        target.load += len(st.req.input_ids) + len(st.delivered)
        target.prefixes.route(st.hashes)
        st.assigned = True

    def _release(self, st: LiveStream) -> None:
        if not st.assigned:
            return
        st.assigned = False
        r = self.replicas[st.target]
        r.inflight = max(r.inflight - 1, 0)
        r.prefixes.unroute(st.hashes)

    # ---- introspection --------------------------------------------------------------------------
    async def replica_stats(self) -> list[SchedulerStats | None]:
        """Per routing target (replica or DP rank), None for one that is down."""
        return await asyncio.gather(*(self._target_stats(r.index) for r in self.replicas))

    async def _target_stats(self, i: int) -> SchedulerStats | None:
        if not self.replicas[i].alive:
            return None
        try:
            return await asyncio.wait_for(self._actor(i).stats.remote(), self.health_timeout_s)
        except Exception:
            return None

    def replica_stats_sync(self) -> list[SchedulerStats | None]:
        return asyncio.run_coroutine_threadsafe(self.replica_stats(), self._loop).result()

    def _actor(self, i: int) -> Any:
        group = self.groups[self._target_group[i]]
        return group.schedulers[i - self._first_target(group.index)]

    def _first_target(self, group_index: int) -> int:
        return self._target_group.index(group_index)

    def _targets_of(self, group_index: int) -> list[int]:
        return [i for i, g in enumerate(self._target_group) if g == group_index]

    # ---- background loop: pumps, health, relaunch ------------------------------------------------
    async def _start(self) -> None:
        for g in self.groups:
            await self._start_pumps(g)
        self._spawn(self._health_loop())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_pumps(self, group: ReplicaGroup) -> None:
        """Opens each target's link (before it takes requests), then its pump."""
        for i in self._targets_of(group.index):
            seq = self.replicas[i].prefixes.seq if self.policy.wants_page_hashes else None
            link = await self._links.open(i, self._actor(i), seq)
            self._spawn(self._pump(i, group.generation, link))

    async def _pump(self, i: int, generation: int, link: RequestLink | None = None) -> None:
        gi = self._target_group[i]
        actor = self._actor(i)
        prefixes = self.replicas[i].prefixes
        wants_cache = self.policy.wants_page_hashes
        while not self._closing and self.groups[gi].generation == generation:
            try:
                poll = await self._links.next_answer(i, actor, link, prefixes.seq if wants_cache else None,
                                                     self.health_timeout_s)
            except Exception as e:
                if not self._closing:
                    self._on_failure(gi, generation, self._failure_message(gi, e))
                return
            if self.groups[gi].generation != generation:
                return
            if poll.cache is not None:  # before the outputs: a finished request's prefix is in it
                prefixes.apply(poll.cache)
            batch, moving = [], {}
            now = time.perf_counter()
            for out in poll.outputs:
                if out.trace is not None:
                    out.trace.received = now
                st = self._streams.get(out.rid)
                if st is None or st.target != i or st.generation != generation or st.finished:
                    continue  # gone, or moved elsewhere: what the old replica still says is stale
                fr = out.finish_reason
                if out.finished and fr is not None and fr.code in (ENGINE_UNHEALTHY, REPLICA_FAILED):
                    moving[out.rid] = fr  # the replica's failure, never ran there: it moves below
                    continue
                st.record(out)  # a step's own error too: moving it would fail the next replica alike
                batch.append((st.loop, st.queue, out))
            deliver(batch)
            if moving or not poll.healthy:
                why = poll.error or next(iter(moving.values())).message or "it refused a request"
                self._on_failure(gi, generation, f"replica {gi} failed: {why}")
                return

    def _on_failure(self, gi: int, generation: int, message: str) -> None:
        """On the client loop: route around the group, relaunch it in the background, and move each of
        its in-flight requests (of that generation) to a live replica."""
        if self._closing:
            return
        group = self.groups[gi]
        targets = set(self._targets_of(gi))
        if group.generation == generation and gi not in self._restarting:
            logger.error("%s; relaunching it", message)
            self._mark_down(gi, message)
            self._restarting.add(gi)
            for i in targets:
                self.replicas[i].alive = False
                self.replicas[i].load = 0.0
                self._links.drop(i)
            self._spawn(self._relaunch(gi))
        for st in list(self._streams.values()):
            if st.target in targets and st.generation == generation:
                self._fail_over(st, message)

    def _fail_over(self, st: LiveStream, message: str) -> None:
        """On the client loop: resubmit st elsewhere with what it already streamed, or end it: when no replica
        is left, or when it has moved once per routing target (a request that breaks every replica it runs on
        must not go round them all; one whose own step broke a replica already ends there, unmoved)."""
        with self._route_lock:
            if st.finished or self._streams.get(st.req.rid) is not st:
                return
            self._release(st)
            if st.moves >= len(self.replicas):
                st.finished = True
                self.failover_errors += 1
                times = "1 time" if st.moves == 1 else f"{st.moves} times"
                st.fail(f"{message}; not moved again: it has moved {times} already")
                return
            try:
                target = self.policy.pick(st.req, self.replicas, st.hashes)
            except EngineUnavailableError:
                st.finished = True
                self.failover_errors += 1
                st.fail(f"{message}; no healthy replica is left to continue the request on")
                return
            st.target, st.generation = target.index, self.groups[self._target_group[target.index]].generation
            st.moves += 1
            self._assign(st, target)
            self.failovers += 1
            resumed = st.resumed_request()
        logger.warning("request %s moves to replica target %d after %d streamed tokens (%s)",
                       st.req.rid, st.target, len(resumed.resumed_output_ids), message)
        self._spawn(self._resubmit(st, resumed))

    async def _resubmit(self, st: LiveStream, resumed: GenerateRequest) -> None:
        i, generation = st.target, st.generation
        try:
            await self._links.submit(i, self._actor(i), resumed)
        except Exception as e:  # that one died too: its failure moves st on again
            gi = self._target_group[i]
            self._on_failure(gi, generation, self._failure_message(gi, e))

    # ---- shutdown -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        for st in list(self._streams.values()):
            st.fail("the engine is shutting down")

        async def stop() -> None:
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._links.close()  # on the loop: its output connections are that loop's transports

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        except Exception:
            logger.debug("stopping client tasks failed", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        kill_all(self.groups)
        self.launcher.shutdown()
        if self.owns_ray:
            import ray

            ray.shutdown()

    def __enter__(self) -> RayEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
