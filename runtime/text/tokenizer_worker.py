"""TokenizerWorker: the threads that encode and render inputs off the gateway's event loop, in two lanes of
one thread each, first in first out within a lane. The large lane takes large bodies; the small lane takes
small inputs that go off the loop only because they may grow (a chat with tools or documents, whose template
may write far more than the body holds; a truncating rerank), so a small job never waits behind a large one.

Admission is by queued work, not by job count. The large lane refuses a job (TokenizerBusyError, the
gateway's 503 with Retry-After) only when the bytes already in it would take more than MAX_QUEUED_S at its
measured encode rate; the small lane, whose jobs are each bounded by a small body, only past SMALL_JOBS. A job
whose caller no longer wants it (its client left) is skipped when its turn comes, and one cancelled while
queued leaves its lane at once (its Future's cancel: ThreadPoolExecutor never starts it)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from runtime.errors import RequestAbortedError, ShoalError

T = TypeVar("T")

# The most encoding a new large job may find queued before it. A request that would wait longer than a minute
# for the tokenizer outlives common client and proxy timeouts (nginx's proxy_read_timeout is 60 s), so it is
# better refused at once to retry elsewhere; anything less is normal load (64 concurrent 70 KB prompts are
# 4.5 MB: seconds), which vLLM's one-thread tokenizer, with its unbounded queue, never refuses either.
MAX_QUEUED_S = 60.0
FIRST_RATE = 300_000.0  # bytes/s before any job is measured: a 3 MB prompt encodes in ~9 s on one core
# Small-lane jobs queued or running at most: each is a body under the gateway's off-loop size, so the count
# bounds what they hold (1024 x 64 KB); far above normal load (Ray Serve's replica takes 256 requests)
SMALL_JOBS = 1024
_KEEP = 0.8  # weight of the past in the moving averages: the last ~5 jobs say how fast the lane goes now


class TokenizerBusyError(ShoalError):
    """A lane holds too much work: not the request's fault, a retry after retry_after_s may pass."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s


class _Lane:
    """One thread and what is queued on it: jobs and their bytes, and its measured rate."""

    def __init__(self, name: str, first_rate: float):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.jobs = 0  # queued or running
        self.bytes = 0  # their sizes
        # Moving averages of a measured job's bytes and seconds: their ratio weighs a job by its size, so a
        # tiny job's fixed cost does not swing the rate
        self.job_bytes, self.job_s = first_rate, 1.0
        self.job_wall_s = 1.0  # moving average of any job's seconds (the small lane's sizes say little)

    @property
    def rate(self) -> float:
        """Bytes encoded per second, as measured."""
        return self.job_bytes / self.job_s

    def learn(self, size: int, seconds: float) -> None:
        self.job_wall_s = _KEEP * self.job_wall_s + (1 - _KEEP) * seconds
        if size > 0:
            self.job_bytes = _KEEP * self.job_bytes + (1 - _KEEP) * size
            self.job_s = _KEEP * self.job_s + (1 - _KEEP) * max(seconds, 1e-6)


class TokenizerWorker:
    def __init__(self, max_queued_s: float = MAX_QUEUED_S, small_jobs: int = SMALL_JOBS,
                 first_rate: float = FIRST_RATE):
        self.max_queued_s, self.small_jobs = max_queued_s, small_jobs
        self.small = _Lane("shoal-tokenize-small", first_rate)
        self.large = _Lane("shoal-tokenize-large", first_rate)
        # Submits come from every gateway loop sharing this tokenizer; ends from the lanes' threads
        self._lock = threading.Lock()

    @property
    def depth(self) -> int:
        """Jobs queued or running, both lanes."""
        return self.small.jobs + self.large.jobs

    def queued_s(self) -> float:
        """The large lane's queued (and running) bytes over its measured rate: how long a new job waits."""
        return self.large.bytes / self.large.rate

    def submit(self, fn: Callable[[], T], size: int = 0, *, small: bool = False,
               wanted: Callable[[], bool] = lambda: True) -> Future[T]:
        """fn() on a lane's thread once the jobs before it there end, unless wanted() is false by then (the
        Future then holds RequestAbortedError). size: the input's bytes, which fn encodes at the lane's rate;
        small: the small lane, for an input under the off-loop size that may grow. TokenizerBusyError when
        the lane is full: the large lane when its queued bytes would take more than max_queued_s (an empty
        one takes any job), the small lane past small_jobs."""
        lane = self.small if small else self.large
        with self._lock:
            if small and lane.jobs >= self.small_jobs:
                wait = max(1, math.ceil(lane.jobs * lane.job_wall_s))
                raise TokenizerBusyError(f"the server is busy rendering requests ({lane.jobs} wait for its "
                                         f"tokenizer); retry in {wait} s", wait)
            queued = lane.bytes / lane.rate
            if not small and lane.jobs and queued > self.max_queued_s:
                wait = math.ceil(queued)
                raise TokenizerBusyError(f"the server is busy encoding large requests ({lane.jobs} hold "
                                         f"{lane.bytes} bytes, ~{wait} s of its tokenizer's work); retry in "
                                         f"{wait} s", wait)
            lane.jobs += 1
            lane.bytes += size
        try:
            future = lane.pool.submit(self._run, lane, size, fn, wanted)
        except BaseException:  # a pool shut down: the job never counts
            self._end(lane, size)
            raise
        future.add_done_callback(lambda _: self._end(lane, size))  # run, failed or cancelled while queued alike
        return future

    def close(self) -> None:
        """Ends both threads once their jobs have run."""
        self.small.pool.shutdown(wait=False)
        self.large.pool.shutdown(wait=False)

    @staticmethod
    def _run(lane: _Lane, size: int, fn: Callable[[], T], wanted: Callable[[], bool]) -> T:
        if not wanted():
            raise RequestAbortedError("the client disconnected before its input was encoded")
        start = time.monotonic()
        out = fn()
        lane.learn(size, time.monotonic() - start)  # a failed job stopped early: it says nothing of the rate
        return out

    def _end(self, lane: _Lane, size: int) -> None:
        with self._lock:
            lane.jobs -= 1
            lane.bytes -= size
