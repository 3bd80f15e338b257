"""PausableScheduler: the Scheduler with SchedulerHost's pause (runtime/managers/scheduler_host.py's docstring
says how each mode treats the requests): while paused its loop takes messages (aborts, calls) but builds no
batch, as SGLang's event loop skips to the next receive while _engine_paused."""

from __future__ import annotations

import time

from runtime.managers.schedule_batch import ScheduleBatch
from runtime.managers.scheduler import Scheduler
from runtime.managers.step_failure import fail_step


class PausableScheduler(Scheduler):

    paused = False

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        return None if self.paused else super().get_next_batch_to_run()

    def pause_now(self, mode: str) -> int:
        """On the scheduler thread, between two steps: how many requests the mode aborted or retracted."""
        if self.pending is not None:  # the batch in flight finishes its step: its tokens and KV are real
            self.stepping = [self.pending[0]]
            self.watchdog.started = time.monotonic()  # a collect: timed as a step's
            try:
                self._collect_pending()
            except Exception as e:  # as run_forever does with a failed step: nothing waits forever on it
                fail_step(self, e)  # counted once: SchedulerHost.call hands what this raises to the caller alone
                raise
            finally:
                self.watchdog.started = None
        self.paused = True
        if mode == "abort":
            reqs = list(self.reqs)
            for rid in reqs:
                self._abort(rid)
            return len(reqs)
        if mode != "retract":
            return 0
        held = list(self.running) + ([self.chunked_req] if self.chunked_req is not None else [])
        self.running.clear()
        self.chunked_req = None
        for r in reversed(held):  # back at the head of the queue in their order
            self.kv.release_retracted(r)
            r.reset_for_retract()
            self.waiting.insert(0, r)
        return len(held)

    def holds_kv(self) -> int:
        """Requests holding KV (paused in place: computed with the weights serving now)."""
        return sum(r.req_pool_idx is not None for r in self.reqs.values())
