"""StepHealth: whether one scheduler's steps still work (EngineClient.health, GET /health).

A step that raises fails the requests it held and the scheduler serves on (Scheduler.run_forever): most such
failures are one batch's. But some errors leave the device unusable — a sticky CUDA error (an illegal memory
access, a device-side assert, an uncorrectable ECC error) makes every later kernel launch fail too — and a
server that answers /health 200 meanwhile is never restarted. So such a step marks the scheduler unhealthy
with the reason, for good: new requests are refused (EngineUnhealthyError, the gateway's 503) and /health
answers 503, as vLLM's /health does once its EngineCore died (EngineDeadError). Only a restart clears it (on
Ray, the replica's relaunch). Other CUDA errors (an invalid argument, too many resources for a launch, a cuBLAS
status) are one batch's shape, and out of memory (CUBLAS_STATUS_ALLOC_FAILED included) the allocator recovers
from: they count like any other failure. On a CUDA device a sticky-looking error counts as fatal only when the
device still fails a synchronize and a tiny kernel afterwards (a sticky error fails every later call), within
DEVICE_CHECK_TIMEOUT_S (one that hangs fails); a lost TP rank's error (EngineUnavailableError) is its own device's,
so it is taken at its word.

FAILED_STEPS_LIMIT steps failing in a row are not enough on their own: one bad request retried by its client
(the OpenAI SDK retries a 500 twice) fails that many. The scheduler then runs a probe, one greedy token of a
1-token prompt alone in its batch (step_failure.probe_step): unhealthy only if the probe fails too; a
probe that passes starts the count again. A successful step resets the count.

A verdict is published before the failed step's errors are delivered (publishing): a client that got its 500
finds /health 503 already. Readers of the health (current) wait while those errors are being delivered, so on Ray
the answer that says unhealthy carries them too: their requests end there with their error, never moved. A step
that never returns (step_watchdog.py) makes the scheduler unhealthy from another thread, publishing its requests'
errors alike (step_failure.fail_hung_step)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from runtime.engine_client import EngineHealth, EngineUnhealthyError
from runtime.errors import EngineUnavailableError

logger = logging.getLogger(__name__)

DEVICE_CHECK_TIMEOUT_S = 10.0  # a synchronize and a tiny kernel take milliseconds on a working device
FAILED_STEPS_LIMIT = 3  # a few in a row: one bad batch (or two) is not a broken engine
PUBLISH_WAIT_S = 1.0  # delivering a step's outputs takes microseconds: a reader never waits long on a stuck one
# CUDA errors that stay set in the context (every later launch fails with them), as the runtime's messages and
# the driver's enum names say them; matched lowercase.
_STICKY_TEXT = ("illegal memory access", "illegal_address", "device-side assert", "unspecified launch failure",
                "launch_failed", "misaligned address", "illegal instruction", "uncorrectable ecc",
                "ecc_uncorrectable", "hardware stack error", "invalid program counter", "launch timed out",
                "uncorrectable nvlink")
_OOM_TEXT = ("out of memory", "cublas_status_alloc_failed")  # cuBLAS could not allocate its workspace


def _chain(e: BaseException) -> Iterator[BaseException]:
    """e and what it wraps: a TP rank's error arrives wrapped (a Ray task error's `cause`, raise ... from)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = getattr(cur, "cause", None) or cur.__cause__ or cur.__context__


def is_fatal(e: BaseException) -> bool:
    """e (or an error it wraps) says a sticky device error: no later step recovers from it. Out of memory never."""
    for cur in _chain(e):
        text = str(cur).lower()
        if isinstance(cur, torch.OutOfMemoryError) or any(t in text for t in _OOM_TEXT):
            return False
        if any(t in text for t in _STICKY_TEXT):
            return True
    return False


def device_still_fails(device: str, timeout_s: float = DEVICE_CHECK_TIMEOUT_S) -> bool:
    """A CUDA context holding a sticky error fails every later call: a synchronize and a tiny kernel raise. It
    runs under the scheduler's lock, so in a daemon thread, waited for at most timeout_s: a synchronize that
    never returns (a stream stuck in a collective with a dead peer) is a device that fails too."""
    failed: list[bool] = []

    def check() -> None:
        try:
            torch.cuda.set_device(device)  # a new thread starts on device 0
            torch.cuda.synchronize(device)
            torch.ones(1, device=device).add_(1).item()
            failed.append(False)
        except Exception:
            failed.append(True)

    t = threading.Thread(target=check, name="shoal-device-check", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        logger.error("the device check on %s did not return within %.0f s: the device counts as failed",
                     device, timeout_s)
        return True
    return failed[0]


def _describe(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


class StepHealth:
    """Written on the scheduler thread (and the watchdog's, once); `state` is replaced whole, so any thread reads it
    without a lock while healthy (current)."""

    def __init__(self, limit: int = FAILED_STEPS_LIMIT):
        self.limit = limit
        self.failed_in_a_row = 0
        self.last: BaseException | None = None  # the latest failure
        self.state = EngineHealth()
        self._publishing = threading.RLock()  # held from a verdict until the failed step's outputs are delivered
        self.device: str | None = None  # a CUDA device confirms a sticky-looking error (device_still_fails)
        self.device_check_timeout_s = DEVICE_CHECK_TIMEOUT_S

    def succeeded(self) -> None:
        self.failed_in_a_row = 0

    def fatal(self, e: BaseException) -> bool:
        # A lost TP rank's error is that rank's device's: this one's check says nothing of it.
        return is_fatal(e) and (self.device is None or isinstance(e, EngineUnavailableError)
                                or device_still_fails(self.device, self.device_check_timeout_s))

    def failed(self, e: BaseException) -> str | None:
        """Counts a failed step; the reason it makes the engine unhealthy when e is fatal, else None (see
        probe_due). Nothing changes until publishing: the caller first ends the step's requests."""
        self.failed_in_a_row += 1
        self.last = e
        if self.state.healthy and self.fatal(e):
            return f"a scheduler step met a device error no later step recovers from ({_describe(e)})"
        return None

    @property
    def probe_due(self) -> bool:
        """The limit of failures in a row is reached: a probe decides (probed)."""
        return self.state.healthy and self.failed_in_a_row >= self.limit

    def probed(self, error: BaseException | None) -> str | None:
        """The probe's outcome: None when it passed (the count starts again), else the reason to be unhealthy."""
        last = _describe(self.last) if self.last is not None else "an unknown error"
        if error is None:
            logger.warning("%d scheduler steps failed in a row (the last with %s), but a probe request passed: "
                           "still serving", self.failed_in_a_row, last)
            self.failed_in_a_row = 0
            return None
        return (f"{self.failed_in_a_row} scheduler steps failed in a row, the last with {last}, and a probe "
                f"request alone in its batch failed too ({_describe(error)})")

    def mark_unhealthy(self, reason: str) -> None:
        """Unhealthy from now on, for good; the first reason stays."""
        with self.publishing(reason, wait_s=PUBLISH_WAIT_S):
            pass

    @contextmanager
    def publishing(self, reason: str | None, wait_s: float | None = None) -> Iterator[None]:
        """The block delivers a failed step's outputs. With a reason, the engine is unhealthy from the block's
        start (for good; the first reason stays), and current() waits for its end in other threads (the
        scheduler's own reads pass: an RLock). wait_s: how long to wait for another thread's verdict being
        published (it goes first: its reason is the one a client saw); past it, this one goes on without the
        lock (that thread is stuck delivering). None: as long as it takes."""
        if reason is None:
            yield
            return
        locked = self._publishing.acquire(timeout=-1 if wait_s is None else wait_s)
        first = False
        try:
            first = self.state.healthy
            if first:
                self.state = EngineHealth(healthy=False, reason=reason)
            yield
        finally:
            if locked:
                self._publishing.release()
            if first:  # after the release: a slow log handler must not hold up readers of the health
                logger.critical("the engine is unhealthy: %s", reason)

    def current(self) -> EngineHealth:
        """The state; an unhealthy one once the outputs of the step that made it so are delivered (publishing)."""
        state = self.state
        if not state.healthy and self._publishing.acquire(timeout=PUBLISH_WAIT_S):
            self._publishing.release()
        return state

    def check(self) -> None:
        """EngineUnhealthyError once unhealthy: a new request would only fail in its first step."""
        state = self.current()
        if not state.healthy:
            raise EngineUnhealthyError(state.reason or "unknown")
