"""SchedulerActor: one replica's (or DP rank's) Scheduler as an async Ray actor.

The Scheduler runs unchanged on a background thread with a WorkerGroup over the replica's TP actors as
its WorkerClient. Outputs reach clients through a pump rather than a call per token: each client
(consumer) long-polls `poll()`, which returns every delta produced for that consumer's requests since
its last poll — one actor call per step for the whole batch however many requests stream. When the
worker group fails, in-flight requests end with an error delta and every later poll says unhealthy."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

import msgspec

from runtime.config import ServerArgs
from runtime.messages import FinishReason, GenerateRequest, RequestOutput, SchedulerStats, WorkerInfo


class OutputPoll(msgspec.Struct, kw_only=True):
    """One poll's answer: the consumer's new deltas, and whether the replica can still serve."""

    outputs: list[RequestOutput] = []
    healthy: bool = True
    error: str | None = None


class SchedulerActor:
    def __init__(self, args: ServerArgs, model_path: str, workers: list[Any], info: WorkerInfo,
                 name: str = "replica 0", dispatch: str = "actor"):
        from runtime.cluster.worker_group import WorkerGroup
        from runtime.managers.scheduler import Scheduler
        from runtime.text.tokenizer import Tokenizer

        self.name = name
        self.tokenizer = Tokenizer(args.tokenizer_path or model_path, tuple(info.eos_token_ids))
        self._stop = threading.Event()
        self.group = WorkerGroup(workers, dispatch, name, on_failure=lambda _e: self._stop.set())
        self.scheduler = Scheduler(
            args, self.group, max_total_tokens=info.max_total_tokens, max_reqs=info.max_reqs,
            context_len=info.context_len, vocab_size=info.vocab_size,
            eos_token_ids=self.tokenizer.eos_token_ids, sink=self._sink,
            decode_text=lambda ids: self.tokenizer.decode(ids))
        self._lock = threading.Lock()
        self._owner: dict[str, str] = {}  # rid → consumer that submitted it
        self._pending: dict[str, list[RequestOutput]] = {}  # consumer → deltas not yet polled
        self._wakeups: dict[str, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self.scheduler.run_forever, args=(self._stop,),
                                        name=f"shoal-scheduler-{name}", daemon=True)
        self._thread.start()

    # ---- scheduler thread → consumers -----------------------------------------------------------
    def _sink(self, outputs: list[RequestOutput]) -> None:
        touched: set[str] = set()
        with self._lock:
            for o in outputs:
                consumer = self._owner.pop(o.rid, None) if o.finished else self._owner.get(o.rid)
                if consumer is not None:
                    self._pending.setdefault(consumer, []).append(o)
                    touched.add(consumer)
        loop = self._loop
        if loop is not None:
            for c in touched:
                event = self._wakeups.get(c)
                if event is not None:
                    loop.call_soon_threadsafe(event.set)

    def _take(self, consumer: str) -> list[RequestOutput]:
        with self._lock:
            return self._pending.pop(consumer, [])

    # ---- actor API ------------------------------------------------------------------------------
    async def ready(self) -> str:
        return self.name

    def healthy(self) -> bool:
        return self.group.failed is None and self._thread.is_alive()

    async def submit(self, req: GenerateRequest, consumer: str) -> None:
        """The request must have passed validation (RayEngineClient.validate)."""
        self._loop = asyncio.get_running_loop()
        if not self.healthy():
            self._error_out([req.rid], consumer)
            return
        with self._lock:
            self._owner[req.rid] = consumer
        self.scheduler.submit(req)

    async def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    async def poll(self, consumer: str, timeout_s: float = 1.0) -> OutputPoll:
        """Deltas for `consumer`'s requests; waits up to timeout_s for the first one."""
        self._loop = asyncio.get_running_loop()
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
        if not self.healthy():
            self._fail_unstarted()
            outputs += self._take(consumer)
        failed = self.group.failed
        return OutputPoll(outputs=outputs, healthy=self.healthy(),
                          error=str(failed) if failed else None if self.healthy() else "scheduler stopped")

    async def stats(self) -> SchedulerStats:
        return await asyncio.to_thread(self._stats)

    def _stats(self) -> SchedulerStats:
        with self.scheduler.lock:  # held for a whole step: read off the event loop
            return self.scheduler.get_stats()

    async def health(self) -> bool:
        return self.healthy()

    async def shutdown(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 10)

    # ---- failure --------------------------------------------------------------------------------
    def _fail_unstarted(self) -> None:
        """After the scheduler thread stopped, requests still in its inbox would never be answered."""
        if self._thread.is_alive():
            return
        rids = []
        while True:
            try:
                kind, item = self.scheduler.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                rids.append(item.rid)
        with self._lock:
            owners = {rid: self._owner.pop(rid, None) for rid in rids}
        for rid, consumer in owners.items():
            if consumer is not None:
                self._error_out([rid], consumer)

    def _error_out(self, rids: list[str], consumer: str) -> None:
        message = str(self.group.failed) if self.group.failed else f"{self.name} is not serving"
        with self._lock:
            self._pending.setdefault(consumer, []).extend(
                RequestOutput(rid=rid, new_token_ids=[], finished=True,
                              finish_reason=FinishReason("error", message=message)) for rid in rids)
