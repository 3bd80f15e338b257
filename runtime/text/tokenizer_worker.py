"""TokenizerWorker: the one thread that encodes and renders large inputs off the gateway's event loop, with
a bounded queue. A job counts from its submit until it ends (queued or running); past MAX_DEPTH a submit is
refused (TokenizerBusyError, the gateway's 503 with Retry-After), so a burst of large bodies cannot queue
minutes of encoding in front of a legitimate one. A job whose caller no longer wants it (its client left) is
skipped when its turn comes, and one cancelled while queued leaves the count at once (its Future's cancel:
ThreadPoolExecutor never starts it)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from runtime.errors import RequestAbortedError, ShoalError

T = TypeVar("T")

# Jobs queued or running at most. Each is a body past the off-loop threshold: a 3 MB prompt encodes in ~9 s
# on one core, so 8 in line is already a minute of encoding; a request behind more would wait longer than
# its client does (and its body sits in memory meanwhile), so it is refused at once to retry later.
MAX_DEPTH = 8
_FIRST_JOB_S = 1.0  # the running estimate of one job's seconds, before any job has run
_MAX_RETRY_S = 60


class TokenizerBusyError(ShoalError):
    """The worker holds MAX_DEPTH jobs: not the request's fault, a retry after retry_after_s may pass."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s


class TokenizerWorker:
    def __init__(self, max_depth: int = MAX_DEPTH):
        self.max_depth = max_depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-tokenize")
        # Submits come from every gateway loop sharing this tokenizer; ends from the worker thread.
        self._lock = threading.Lock()
        self._depth = 0
        self._job_s = _FIRST_JOB_S  # moving average of a job's seconds: what Retry-After is made of

    @property
    def depth(self) -> int:
        """Jobs queued or running."""
        return self._depth

    def submit(self, fn: Callable[[], T], wanted: Callable[[], bool] = lambda: True) -> Future[T]:
        """fn() on the worker thread once the jobs before it end, unless wanted() is false by then (the
        Future then holds RequestAbortedError); TokenizerBusyError when max_depth jobs are in already."""
        with self._lock:
            if self._depth >= self.max_depth:
                wait = min(_MAX_RETRY_S, max(1, math.ceil(self._depth * self._job_s)))
                raise TokenizerBusyError(f"the server is busy encoding large requests ({self._depth} wait for its "
                                         f"tokenizer); retry in {wait} s", wait)
            self._depth += 1
        try:
            future = self._pool.submit(self._run, fn, wanted)
        except BaseException:  # a pool shut down: the job never counts
            self._end()
            raise
        future.add_done_callback(lambda _: self._end())  # run, failed or cancelled while queued alike
        return future

    def _run(self, fn: Callable[[], T], wanted: Callable[[], bool]) -> T:
        if not wanted():
            raise RequestAbortedError("the client disconnected before its input was encoded")
        start = time.monotonic()
        try:
            return fn()
        finally:
            self._job_s = 0.8 * self._job_s + 0.2 * (time.monotonic() - start)

    def _end(self) -> None:
        with self._lock:
            self._depth -= 1
