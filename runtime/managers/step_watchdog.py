"""StepWatchdog: a scheduler step that never returns makes the engine unhealthy (SGLang's --watchdog-timeout).

A step stuck on the device (a collective whose peer died, a kernel that never ends) raises nothing: the scheduler
thread just stops, its requests wait for good, and /health would answer 200 meanwhile. SGLang's scheduler runs a
watchdog thread that, once one forward batch has run past --watchdog-timeout (300 s), dumps the stacks and kills
the server. Here it marks the scheduler unhealthy (StepHealth) with the reason, for good: /health answers 503, so
Kubernetes' liveness probe restarts the pod, and on Ray the replica's actor answers unhealthy and its client
relaunches it. Every thread's stack is logged once, at ERROR: where it hangs. The requests end at once
(step_failure.fail_hung_step): those in the stuck step with an error naming the watchdog (on Ray never moved: a
request that hangs one replica's step would hang the next one's too), the others with ENGINE_UNHEALTHY (on Ray
they move to a healthy replica), those submitted during the hang (left in the inbox) included. While that step
still hangs (stuck()) it holds the scheduler's lock and its thread answers nothing: a call to the scheduler
(SchedulerHost.call: admin calls) fails at once with EngineUnhealthyError, and stats (/metrics) are read
without the lock.

The check runs on a daemon thread of its own, never on the stuck one. The step loop only writes `started` (a
time.monotonic() stamp) as a step begins and None once it is over: no lock per step. A step is the work on a batch
(its forward, the collect of the batch in flight, the results, a failure's probe); what runs between steps (a
weight update called on the scheduler thread takes minutes) is not one. A step is flagged only once it has run
longer than the timeout: the clock is read before the stamp, so a step that ended meanwhile is never measured long.
An IDLE step (DP attention: a rank with nothing to do) is not timed: it waits in a collective for its peers, and a
peer running a call between its steps (untimed there: a profile stop writing its trace) would make it look hung.

What it cannot see: a call between steps that hangs on the device (wake_up, a weight update, a profile stop) runs
untimed, so it hangs the scheduler with /health still 200 (only that call's caller times out, SchedulerHost.call).
And, as in SGLang, it cannot tell a slow step from a hung one: a first-use kernel compile (a Triton JIT or autotune)
longer than the timeout makes the engine unhealthy. `--watchdog-timeout` 0, a negative value, None or inf turns it
off (no thread)."""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import TypeVar

from runtime.engine_client import EngineUnhealthyError
from runtime.managers.step_health import StepHealth

logger = logging.getLogger(__name__)

POLL_LIMIT_S = 5.0  # a hang is seen at most this late past the timeout (SGLang looks every timeout / 2)
CALL_POLL_S = 0.2  # how often a caller waiting on the scheduler looks for the verdict
T = TypeVar("T")


class StepWatchdog:
    def __init__(self, timeout_s: float | None, health: StepHealth,
                 on_hang: Callable[[str, float], None] | None = None):
        """on_hang(reason, started): on the watchdog's thread, once the step stamped `started` ran past the
        timeout; it must make `health` unhealthy (the default does only that)."""
        on = timeout_s is not None and 0 < timeout_s < math.inf  # <= 0, None or inf: off
        self.timeout_s = timeout_s if on else None
        self.health = health
        self.on_hang = on_hang or (lambda reason, started: health.mark_unhealthy(reason))
        self.started: float | None = None  # time.monotonic() as the step in progress began; None between steps
        self.hung: str | None = None  # the verdict's reason, once a step ran past the timeout (for good)
        self.hung_started: float | None = None  # that step's stamp

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Watches the calling thread's steps while the block (the step loop) runs."""
        if self.timeout_s is None:
            yield
            return
        stop = threading.Event()
        stepper = threading.current_thread()
        watcher = threading.Thread(target=self._watch, args=(stop, stepper), name=f"{stepper.name}-watchdog",
                                   daemon=True)
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            self.started = None
            # Joined, not left to end on its own: its frame holds the scheduler (on_hang), and an engine shut
            # down must be collectable at once (stop.wait returns as soon as it is set)
            watcher.join(timeout=CALL_POLL_S * 5)

    def stuck(self) -> bool:
        """The step flagged as hung still runs: it holds the scheduler's lock, and nothing it would take from the
        inbox is taken. False again should it return after all."""
        return self.hung_started is not None and self.started == self.hung_started

    def refuse_calls(self) -> None:
        """EngineUnhealthyError while stuck(): a call to the scheduler (SchedulerHost.call) would wait for good."""
        if self.stuck():
            raise self._refusal()

    def _refusal(self) -> EngineUnhealthyError:
        return EngineUnhealthyError(f"{self.hung}; a call to the scheduler would wait for that step")

    def wait(self, answer: Future[T], timeout_s: float) -> T:
        """A call's answer (FutureTimeout past timeout_s), looked at every CALL_POLL_S: once stuck(), a call not
        begun is withdrawn (EngineUnhealthyError), not waited for the hours its caller may allow."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return answer.result(max(0.0, min(CALL_POLL_S, deadline - time.monotonic())))
            except FutureTimeout:
                if self.stuck() and answer.cancel():
                    raise self._refusal() from None
                if time.monotonic() >= deadline:
                    raise

    @contextmanager
    def holding(self, lock: threading.Lock) -> Iterator[None]:
        """The scheduler's lock; EngineUnhealthyError instead once the step holding it is stuck()."""
        while not lock.acquire(timeout=CALL_POLL_S):
            self.refuse_calls()
        try:
            yield
        finally:
            lock.release()

    def overdue(self) -> float | None:
        """How long the step in progress has run, when that is past the timeout; else None."""
        late = self._late()
        return None if late is None else late[0]

    def _late(self) -> tuple[float, float] | None:
        """(how long it has run, its stamp) for a step in progress past the timeout."""
        now = time.monotonic()  # before the stamp: a step that ended since is never measured long
        started = self.started
        if self.timeout_s is None or started is None or now - started <= self.timeout_s:
            return None
        return now - started, started

    def check(self, stepper: threading.Thread) -> bool:
        """True once the step in progress has run past the timeout: the engine is now unhealthy, the stacks logged."""
        late = self._late()
        if late is None:
            return False
        ran, started = late
        logger.error("a scheduler step has run for %.1f s, past --watchdog-timeout %g s: it hangs (a collective "
                     "waiting for a dead peer, a kernel that never ends); the threads' stacks:\n%s",
                     ran, self.timeout_s, thread_stacks(stepper))
        reason = f"a step has run for {ran:.1f} s (--watchdog-timeout)"
        # Before on_hang: a submitter that finds the verdict set ends its own request (Scheduler.submit), one
        # that does not has put it in the inbox before on_hang drains it (step_failure.fail_hung_step)
        self.hung, self.hung_started = reason, started  # in this order: stuck() says a reason is there
        try:
            self.on_hang(reason, started)
        except Exception:  # ending its requests failed: the verdict stands all the same
            logger.exception("ending the hung step's requests failed")
            self.health.mark_unhealthy(reason)
        return True

    def _watch(self, stop: threading.Event, stepper: threading.Thread) -> None:
        interval = min(self.timeout_s / 4, POLL_LIMIT_S)
        while not stop.wait(interval) and stepper.is_alive():
            if self.check(stepper):
                return  # unhealthy for good: the stacks are logged once


def thread_stacks(first: threading.Thread) -> str:
    """Every thread's stack, `first` (the stuck step's) first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != first.ident)
    return "\n".join(f"Thread {names.get(ident, ident)}{' (the step)' if ident == first.ident else ''}:\n"
                     + "".join(traceback.format_stack(frame)) for ident, frame in frames)
