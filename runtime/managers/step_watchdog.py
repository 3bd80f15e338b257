"""StepWatchdog: a scheduler step that never returns makes the engine unhealthy (SGLang's --watchdog-timeout).

A step stuck on the device (a collective whose peer died, a kernel that never ends) raises nothing: the scheduler
thread just stops, its requests wait for good, and /health would answer 200 meanwhile. SGLang's scheduler runs a
watchdog thread that, once one forward batch has run past --watchdog-timeout (300 s), dumps the stacks and kills
the server. Here it marks the scheduler unhealthy (StepHealth) with the reason, for good: /health answers 503, so
Kubernetes' liveness probe restarts the pod, and on Ray the replica's actor answers unhealthy and its client
relaunches it, moving its requests. Every thread's stack is logged once, at ERROR: where it hangs.

The check runs on a daemon thread of its own, never on the stuck one. The step loop only writes `started` (a
time.monotonic() stamp) as a step begins and None once it is over: no lock per step. A step is the work on a batch
(its forward, the collect of the batch in flight, the results, a failure's probe); what runs between steps (a
weight update called on the scheduler thread takes minutes) is not one. A step is flagged only once it has run
longer than the timeout: the clock is read before the stamp, so a step that ended meanwhile is never measured long."""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from runtime.managers.step_health import StepHealth

logger = logging.getLogger(__name__)

POLL_LIMIT_S = 5.0  # a hang is seen at most this late past the timeout (SGLang looks every timeout / 2)


class StepWatchdog:
    def __init__(self, timeout_s: float | None, health: StepHealth):
        self.timeout_s = timeout_s if timeout_s is not None and timeout_s > 0 else None  # <= 0 or None: off
        self.health = health
        self.started: float | None = None  # time.monotonic() as the step in progress began; None between steps

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

    def overdue(self) -> float | None:
        """How long the step in progress has run, when that is past the timeout; else None."""
        now = time.monotonic()  # before the stamp: a step that ended since is never measured long
        started = self.started
        if self.timeout_s is None or started is None or now - started <= self.timeout_s:
            return None
        return now - started

    def check(self, stepper: threading.Thread) -> bool:
        """True once the step in progress has run past the timeout: the engine is now unhealthy, the stacks logged."""
        ran = self.overdue()
        if ran is None:
            return False
        logger.error("a scheduler step has run for %.1f s, past --watchdog-timeout %g s: it hangs (a collective "
                     "waiting for a dead peer, a kernel that never ends); the threads' stacks:\n%s",
                     ran, self.timeout_s, thread_stacks(stepper))
        self.health.mark_unhealthy(f"a step has run for {ran:.1f} s (--watchdog-timeout)")
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
