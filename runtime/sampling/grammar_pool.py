"""GrammarPool: the compile jobs of GrammarCompiler by grammar — queued, running, or done (an LRU cache) —
and the few threads that run them, oldest first. Identical grammars share one job, and a job counts the
requests waiting for it: a job no thread has started is dropped once its last waiter leaves (its request
aborted, disconnected, or past its deadline), so it never runs and the next job gets its thread. Without
that, a client sending 64 slow grammars and leaving kept every later grammar busy (a 503) until all 64
had compiled. A started job runs to its end (xgrammar cannot interrupt a compile) and is cached: its
thread is spent either way, and a client retrying the same grammar then finds it compiled. SGLang does
the same per request: an abort or a timeout cancels the request's pending compile future.

The threads are not daemons: xgrammar releases the GIL while it compiles, and a daemon thread coming back
into a finalizing interpreter is killed mid-C++ (std::terminate, the process aborts). As concurrent.futures
does, the pool closes before the interpreter joins its threads at exit (threading._register_atexit), so an
idle thread ends and a running compile is waited for, up to join_s (the compile time limit); shutdown()
joins them too, up to the same bound. A compile still running past that at exit may never end, and the
interpreter would join its thread for good: the pool logs it and ends the process (os._exit) after
the exit's remaining cleanup, rather than let it hang or return into a finalizing interpreter."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from runtime.errors import EngineUnavailableError

Key = tuple[str, str]

# The exit status of a process whose exit gave up on a running compile. The status it was exiting with
# cannot be read from a threading exit hook (Py_Exit consumed sys.exit's code before the hooks run), and
# such an exit is not a clean one either way.
ABANDONED_EXIT_STATUS = 1
EXIT_JOIN_FLOOR_S = 1.0  # the least the exit waits for the threads (a tiny --grammar-compile-timeout-s aside)

logger = logging.getLogger(__name__)


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


def shut_down_error() -> EngineUnavailableError:
    return EngineUnavailableError("the grammar compiler is shut down")


class GrammarPool:
    def __init__(self, threads: int, max_queued: int, cache_size: int, prepare: Callable[[], Any],
                 compile_: Callable[[Key], Any], join_s: float = 10.0):
        """prepare: run on a thread before it starts a job (xgrammar's tokenizer tables load at the first
        grammar, outside its time limit); its failure fails that job. compile_: a key's compiled grammar.
        join_s: how long shutdown(), and the exit, wait for a running compile to end."""
        self._threads, self._max_queued, self._cache_size = threads, max_queued, cache_size
        self._prepare, self._compile, self._join_s = prepare, compile_, join_s
        self._jobs: OrderedDict[Key, GrammarJob] = OrderedDict()  # every job, by key, least recently used first
        self._pending: deque[GrammarJob] = deque()  # jobs no thread has started, oldest first
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._workers: list[threading.Thread] = []  # started at the first job: most servers see no grammar
        self._closed = False
        self._exit_hook: Callable[[], None] | None = None  # registered with the first thread

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
        wait for a thread already (the caller refuses as busy). EngineUnavailableError once shut down:
        no thread would ever run a new job."""
        with self._lock:
            job = self._jobs.get(key)  # another caller may have queued it since find()
            if job is None or job.failed():
                if self._closed:
                    raise shut_down_error()
                if len(self._pending) >= self._max_queued:
                    return None
                self._start_workers()
                job = self._jobs[key] = GrammarJob(key)
                self._pending.append(job)
                self._wake.notify()
                self._evict()
            job.waiters += 1
            self._jobs.move_to_end(key)
            return job

    def _evict(self) -> None:
        """Forgets the least recently used compiled (or failed) grammars past cache_size. A queued or
        running job stays: its waiters hold it, and a new caller of the same grammar must share it, not
        queue a second compile. Live jobs number at most threads + max_queued, far below cache_size."""
        excess = len(self._jobs) - self._cache_size
        if excess <= 0:
            return
        done = [k for k, j in self._jobs.items() if j.future.done()][:excess]
        for k in done:
            del self._jobs[k]

    def leave(self, job: GrammarJob) -> None:
        """One waiter of job stops waiting (its request ended, for whatever reason): each join/find once.
        The last one leaving a job no thread has started drops it: it never runs."""
        with self._lock:
            if job.waiters <= 0:  # a caller's bookkeeping bug: clamping it would hide a double leave
                logger.error("a %s grammar's compile job was left more often than joined", job.key[0],
                             stack_info=True)
                return
            job.waiters -= 1
            if job.waiters or job.started is not None or job.future.done():
                return
            if job not in self._pending:  # shutdown() took the queue: it cancels the job
                return
            self._pending.remove(job)
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
        job.future.cancel()  # outside the lock: its done-callbacks run here and may call back into the pool

    def cached(self, key: Key) -> bool:
        with self._lock:
            job = self._jobs.get(key)
            return job is not None and job.future.done() and not job.failed()

    def _start_workers(self) -> None:
        """Under the lock. Registers the exit hook first: a thread started once the interpreter is
        finalizing (which refuses the hook) could never be joined."""
        if not self._workers:
            try:
                self._close_at_exit()
            except RuntimeError:
                raise shut_down_error() from None  # the interpreter is exiting
        while len(self._workers) < self._threads:
            t = threading.Thread(target=self._work, name=f"shoal-grammar-{len(self._workers)}")
            try:
                t.start()
            except RuntimeError as e:  # out of threads: the ones started serve; none at all is the engine's
                if self._workers:
                    logger.warning("grammar compiler runs on %d of %d threads: %s", len(self._workers),
                                   self._threads, e)
                    return
                raise EngineUnavailableError(f"the grammar compiler could not start a thread: {e}") from None
            self._workers.append(t)

    def _close_at_exit(self) -> None:
        """Closes the pool before the interpreter joins its threads, waiting up to join_s for a running
        compile (it must end before finalization). Through a weak reference: the hook alone keeps no pool
        alive (a running thread does: its target is the pool's)."""
        ref = weakref.ref(self)

        def close() -> None:
            if (pool := ref()) is not None:
                pool._exit()

        threading._register_atexit(close)
        self._exit_hook = close

    def _unregister_exit_hook(self) -> None:
        """Drops the exit hook of a pool whose threads all ended, so that a process creating many engines
        does not grow threading's hook list. Removal never makes threading._shutdown skip a hook: it
        walks the list backwards, and a removal only shifts the entries it has already visited."""
        hook, self._exit_hook = self._exit_hook, None
        hooks = getattr(threading, "_threading_atexits", None)  # private: without it the hook stays, a no-op
        if hook is None or hooks is None:
            return
        for entry in hooks:  # _register_atexit wraps each hook in a functools.partial
            if entry is hook or getattr(entry, "func", None) is hook:
                with contextlib.suppress(ValueError):
                    hooks.remove(entry)
                return

    def _exit(self) -> None:
        """The interpreter exits: close, and end the process if a compile outlives join_s (EXIT_JOIN_FLOOR_S at
        least: idle threads just woken need a moment to end, whatever the compile time limit)."""
        waited = max(self._join_s, EXIT_JOIN_FLOOR_S)
        if self._close(waited):
            return
        with self._lock:
            running = [j for j in self._jobs.values() if j.started is not None and not j.future.done()]
        names = ", ".join(f"{kind} {text[:80]!r}" for kind, text in (j.key for j in running)) or "unknown"
        logger.error("exiting with a grammar compile still running after %g s (%s): ending the process "
                     "(status %d) rather than wait for it", waited, names, ABANDONED_EXIT_STATUS)
        # What the exit still had to do (atexit: logging's flush among it), then no interpreter
        # finalization: the compile thread would block it for good, or die in C++ returning into it.
        run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
        if run_exitfuncs is not None:
            run_exitfuncs()
        else:
            logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if not any(t.is_alive() for t in self._workers):  # it ended meanwhile: the exit goes on as it began
            return
        os._exit(ABANDONED_EXIT_STATUS)

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
                if self._closed:
                    return
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

    def shutdown(self) -> bool:
        """Refuses new jobs, drops the queued ones (their waiters get EngineUnavailableError) and waits up
        to join_s for a running compile to end. True when every thread has ended; a compile still running
        then ends on its own, and the exit waits up to join_s more for it."""
        ended = self._close(self._join_s)
        if ended:
            self._unregister_exit_hook()
        return ended

    def _close(self, join_s: float) -> bool:
        """shutdown(), waiting join_s at most for the threads."""
        with self._lock:
            self._closed = True
            dropped, self._pending = list(self._pending), deque()
            for job in dropped:
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]
            self._wake.notify_all()
            workers = [t for t in self._workers if t is not threading.current_thread()]
        for job in dropped:  # outside the lock, as in leave()
            job.future.cancel()
        deadline = time.monotonic() + join_s
        for t in workers:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in workers if t.is_alive()]
        if alive:
            logger.warning("grammar compiler shut down with a compile still running on %s after %g s",
                           ", ".join(alive), join_s)
        return not alive
