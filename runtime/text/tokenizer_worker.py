"""TokenizerWorker: the threads that encode and render inputs off the gateway's event loop, in two lanes of
one thread each, first in first out within a lane. The large lane takes large inputs; the small lane takes
small inputs that go off the loop only because they may grow (a chat with tools or documents, whose template
may write far more than the body holds; a truncating rerank), so a small job never waits behind a large one.

Admission is by queued work, not by job count. The large lane refuses a job (TokenizerBusyError, the
gateway's 503 with Retry-After) when what is already in it would take more than MAX_QUEUED_S: each job is
sized by what it works on (an encode by its texts' characters, a render by its body: all that is known
before rendering), and weighed at the measured rate of its kind (encodes and renders apart, so a template
that writes megabytes from a small body does not make every prompt look slow). A rate is learned from every
job that ran, failed ones too, and clamped to [first rate / RATE_SPAN, first rate x RATE_SPAN], so no sender
can teach it to admit terabytes or to refuse all; LARGE_BYTES and LARGE_JOBS bound the lane whatever it has
learned. The small lane refuses past MAX_QUEUED_S of its jobs at their measured mean time, or SMALL_JOBS. A
job whose caller no longer wants it (its client left) is skipped when its turn comes, and one cancelled while
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

# The most work a new job may find queued before it. A request that would wait longer than a minute for the
# tokenizer outlives common client and proxy timeouts (nginx's proxy_read_timeout is 60 s), so it is better
# refused at once to retry elsewhere; anything less is normal load (64 concurrent 70 KB prompts are 4.5 MB:
# seconds), which vLLM's one-thread tokenizer, with its unbounded queue, never refuses either.
MAX_QUEUED_S = 60.0
FIRST_RATE = 300_000.0  # characters/s before any job is measured: a 3 MB prompt encodes in ~9 s on one core
# How far a measured rate may stray from the first: a real tokenizer on a slow or busy core stays well inside
# (fast tokenizers encode ~1 MB/s per core), while a sender's crafted jobs (a body of padding, a template
# that grows) cannot push the lane to admit hours of work or to refuse a burst of ordinary prompts
RATE_SPAN = 10.0
# Backstops of the large lane, whatever its rates say: queued jobs hold their texts (and requests) in memory
# until their turn, so 256 MB bounds that memory (32 bodies of the default 8 MB --max-request-bytes, in text);
# 256 jobs is 4x a burst of 64 concurrent large prompts, far above what one thread serves in a minute
LARGE_BYTES = 256 << 20
LARGE_JOBS = 256
# The small lane's last bound, behind its time estimate: its jobs are each a body under the gateway's
# off-loop size, so the count bounds what they hold (1024 x 64 KB) even while fast jobs make the mean low
SMALL_JOBS = 1024
FIRST_JOB_S = 0.05  # a small-lane job's seconds before any is measured: a tools chat renders in milliseconds
_KEEP = 0.8  # weight of the past in the moving averages: the last ~5 jobs say how fast the lane goes now


class TokenizerBusyError(ShoalError):
    """A lane holds too much work: not the request's fault, a retry after retry_after_s may pass."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s


class _Kind:
    """One kind of job on a lane (encodes or renders): the sizes queued, and the rate measured from those
    run. Moving averages of a job's size and seconds: their ratio weighs a job by its size, so a tiny job's
    fixed cost does not swing the rate."""

    def __init__(self, first_rate: float):
        self.first_rate = first_rate
        self.bytes = 0  # sizes of the jobs queued or running
        self.job_bytes, self.job_s = first_rate, 1.0

    @property
    def rate(self) -> float:
        """Characters worked per second, as measured, within RATE_SPAN of the first rate."""
        return min(max(self.job_bytes / self.job_s, self.first_rate / RATE_SPAN), self.first_rate * RATE_SPAN)

    def queued_s(self) -> float:
        return self.bytes / self.rate

    def learn(self, size: int, seconds: float) -> None:
        if size > 0:
            self.job_bytes = _KEEP * self.job_bytes + (1 - _KEEP) * size
            self.job_s = _KEEP * self.job_s + (1 - _KEEP) * max(seconds, 1e-6)


class _Lane:
    """One thread and what is queued on it: jobs, their sizes and measured rates by kind."""

    def __init__(self, name: str, first_rate: float):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.jobs = 0  # queued or running
        self.encodes, self.renders = _Kind(first_rate), _Kind(first_rate)
        self.job_wall_s = FIRST_JOB_S  # moving average of any job's seconds (the small lane's sizes say little)

    @property
    def bytes(self) -> int:
        """Sizes of the jobs queued or running, both kinds."""
        return self.encodes.bytes + self.renders.bytes

    @property
    def rate(self) -> float:
        """Characters encoded per second, as measured (clamped)."""
        return self.encodes.rate

    def queued_s(self) -> float:
        """Seconds of the queued (and running) jobs at their kinds' rates: how long a new job waits."""
        return self.encodes.queued_s() + self.renders.queued_s()

    def kind(self, renders: bool) -> _Kind:
        return self.renders if renders else self.encodes

    def learn(self, kind: _Kind, size: int, seconds: float) -> None:
        self.job_wall_s = _KEEP * self.job_wall_s + (1 - _KEEP) * seconds
        kind.learn(size, seconds)


class TokenizerWorker:
    def __init__(self, max_queued_s: float = MAX_QUEUED_S, small_jobs: int = SMALL_JOBS,
                 first_rate: float = FIRST_RATE, large_bytes: int = LARGE_BYTES, large_jobs: int = LARGE_JOBS):
        self.max_queued_s, self.small_jobs = max_queued_s, small_jobs
        self.large_bytes, self.large_jobs = large_bytes, large_jobs
        self.small = _Lane("shoal-tokenize-small", first_rate)
        self.large = _Lane("shoal-tokenize-large", first_rate)
        # Submits come from every gateway loop sharing this tokenizer; ends from the lanes' threads
        self._lock = threading.Lock()

    @property
    def depth(self) -> int:
        """Jobs queued or running, both lanes."""
        return self.small.jobs + self.large.jobs

    def queued_s(self) -> float:
        """The large lane's queued (and running) work at its measured rates: how long a new job waits."""
        return self.large.queued_s()

    def submit(self, fn: Callable[[], T], size: int = 0, *, small: bool = False, renders: bool = False,
               wanted: Callable[[], bool] = lambda: True) -> Future[T]:
        """fn() on a lane's thread once the jobs before it there end, unless wanted() is false by then (the
        Future then holds RequestAbortedError). size: the characters fn encodes (renders: the body whose chat
        fn renders), weighed at the lane's rate for that kind; small: the small lane, for an input under the
        off-loop size that may grow. TokenizerBusyError when the lane is full: the large lane when its queued
        work would take more than max_queued_s or past large_bytes or large_jobs (an empty one takes any job),
        the small lane past max_queued_s of jobs at its mean job time or past small_jobs."""
        lane = self.small if small else self.large
        kind = lane.kind(renders)
        with self._lock:
            if lane.jobs:
                self._admit(lane, size)
            lane.jobs += 1
            kind.bytes += size
        try:
            future = lane.pool.submit(self._run, lane, kind, size, fn, wanted)
        except BaseException:  # a pool shut down: the job never counts
            self._end(lane, kind, size)
            raise
        future.add_done_callback(lambda _: self._end(lane, kind, size))  # run, failed or cancelled alike
        return future

    def close(self) -> None:
        """Ends both threads once their jobs have run."""
        self.small.pool.shutdown(wait=False)
        self.large.pool.shutdown(wait=False)

    def _admit(self, lane: _Lane, size: int) -> None:
        """TokenizerBusyError when a non-empty lane cannot take a job of size (under the lock)."""
        if lane is self.small:
            queued = lane.jobs * lane.job_wall_s
            if queued > self.max_queued_s or lane.jobs >= self.small_jobs:
                wait = max(1, math.ceil(queued))
                raise TokenizerBusyError(f"the server is busy rendering requests ({lane.jobs} wait for its "
                                         f"tokenizer, ~{wait} s of work); retry in {wait} s", wait)
            return
        queued = lane.queued_s()
        if queued > self.max_queued_s or lane.bytes + size > self.large_bytes or lane.jobs >= self.large_jobs:
            wait = max(1, math.ceil(queued))
            raise TokenizerBusyError(f"the server is busy encoding large requests ({lane.jobs} hold "
                                     f"{lane.bytes} characters, ~{wait} s of its tokenizer's work); retry in "
                                     f"{wait} s", wait)

    @staticmethod
    def _run(lane: _Lane, kind: _Kind, size: int, fn: Callable[[], T], wanted: Callable[[], bool]) -> T:
        if not wanted():
            raise RequestAbortedError("the client disconnected before its input was encoded")
        start = time.monotonic()
        try:
            return fn()
        finally:  # a failed job (a render past the context) took the lane's time too: it counts alike
            lane.learn(kind, size, time.monotonic() - start)

    def _end(self, lane: _Lane, kind: _Kind, size: int) -> None:
        with self._lock:
            lane.jobs -= 1
            kind.bytes -= size
