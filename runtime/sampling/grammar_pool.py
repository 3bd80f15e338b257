"""GrammarPool: the compile jobs of GrammarCompiler by grammar — queued, running, or done (an LRU cache) —
and the few threads that run them, oldest first. Identical grammars share one job, and a job counts the
requests waiting for it: a job no thread has started is dropped once its last waiter leaves (its request
aborted, disconnected, or past its deadline), so it never runs and the next job gets its thread. Without
that, a client sending 64 slow grammars and leaving kept every later grammar busy (a 503) until all 64
had compiled. A started job runs to its end (xgrammar cannot interrupt a compile) and is cached: its
thread is spent either way, and a client retrying the same grammar then finds it compiled. SGLang does
the same per request: an abort or a timeout cancels the request's pending compile future."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

Key = tuple[str, str]


class GrammarJob:
    """One grammar's compile: its future, when a pool thread started and ended it (monotonic s), and how
    many callers wait for it (GrammarPool.join adds one, GrammarPool.leave takes it back)."""

    __slots__ = ("key", "future", "started", "ended", "waiters")

    def __init__(self, key: Key) -> None:
        self.key = key
        self.future: Future = Future()
        self.started: float | None = None
        self.ended: float | None = None
        self.waiters = 0

    def failed(self) -> bool:
        """Done with an error, or dropped before it started (cancelled)."""
        return self.future.done() and (self.future.cancelled() or self.future.exception() is not None)


class GrammarPool:
    def __init__(self, threads: int, max_queued: int, cache_size: int, prepare: Callable[[], Any],
                 compile_: Callable[[Key], Any]):
        """prepare: run on a thread before it starts a job (xgrammar's tokenizer tables load at the first
        grammar, outside its time limit); its failure fails that job. compile_: a key's compiled grammar."""
        self._threads, self._max_queued, self._cache_size = threads, max_queued, cache_size
        self._prepare, self._compile = prepare, compile_
        self._jobs: OrderedDict[Key, GrammarJob] = OrderedDict()  # every job, by key, least recently used first
        self._pending: deque[GrammarJob] = deque()  # jobs no thread has started, oldest first
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._workers: list[threading.Thread] = []  # started at the first job: most servers see no grammar
        self._closed = False

    @property
    def queued(self) -> int:
        """Jobs waiting for a thread (dropped ones not counted: they are gone)."""
        return len(self._pending)

    def find(self, key: Key) -> GrammarJob | None:
        """key's job, queued, running or compiled, with one more waiter; None if there is none or it
        failed (a failed compile is not kept: the next request gets its error afresh)."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None or job.failed():
                return None
            job.waiters += 1
            self._jobs.move_to_end(key)
            return job

    def join(self, key: Key) -> GrammarJob | None:
        """find(key), or else a new job queued for it with this one waiter; None when max_queued jobs
        wait for a thread already (the caller refuses as busy)."""
        with self._lock:
            job = self._jobs.get(key)  # another caller may have queued it since find()
            if job is None or job.failed():
                if len(self._pending) >= self._max_queued:
                    return None
                job = self._jobs[key] = GrammarJob(key)
                self._pending.append(job)
                self._start_workers()
                self._wake.notify()
                while len(self._jobs) > self._cache_size:
                    self._jobs.popitem(last=False)  # a waiter of an evicted live job still holds it
            job.waiters += 1
            self._jobs.move_to_end(key)
            return job

    def leave(self, job: GrammarJob) -> None:
        """One waiter of job stops waiting (its request ended, for whatever reason): each join/find once.
        The last one leaving a job no thread has started drops it: it never runs."""
        with self._lock:
            job.waiters = max(0, job.waiters - 1)
            if job.waiters or job.started is not None or job.future.done():
                return
            self._pending.remove(job)
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            job.future.cancel()

    def cached(self, key: Key) -> bool:
        with self._lock:
            job = self._jobs.get(key)
            return job is not None and job.future.done() and not job.failed()

    def _start_workers(self) -> None:
        while len(self._workers) < self._threads:
            t = threading.Thread(target=self._work, name=f"shoal-grammar-{len(self._workers)}", daemon=True)
            self._workers.append(t)
            t.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
            failure: BaseException | None = None
            try:
                self._prepare()  # before the job counts as started: its time limit excludes this load
            except BaseException as e:
                failure = e
            with self._lock:
                if not self._pending:  # dropped while the tables loaded
                    continue
                job = self._pending.popleft()
                job.started = time.monotonic()
            self._run(job, failure)

    def _run(self, job: GrammarJob, failure: BaseException | None) -> None:
        try:
            if failure is not None:
                raise failure
            compiled = self._compile(job.key)
        except BaseException as e:
            job.ended = time.monotonic()
            job.future.set_exception(e)
        else:
            job.ended = time.monotonic()
            job.future.set_result(compiled)

    def shutdown(self) -> None:
        """Stops the threads once their compile (if any) ends; the queued jobs are cancelled."""
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending), deque()
            self._wake.notify_all()
        for job in pending:
            job.future.cancel()
