"""LeaderStamps: rank 0's timestamps of its recent steps, attached to each StepChannel message (as the
frame's meta integers) so a follower can line its own timeline up against rank 0's (one monotonic clock
per node) and explain a slow TP step: was rank 0 late to send, the message slow to arrive, the follower
slow to launch? Costs a few clock reads a step, and one CUDA event query."""

from __future__ import annotations

import time
from dataclasses import dataclass

# Meta slots of every message: the step it carries, then what rank 0 knew when it sent it.
BATCH_ID, PREV_ID, PREV_LAUNCHED_NS, FINISHED_ID, FINISH_CALL_NS, FINISH_RETURN_NS, GAP_NS, DEVICE_NS = range(8)


@dataclass(slots=True)
class LeaderStamps:
    prev_id: int = -1  # rank 0's previous launch
    prev_launched_ns: int = 0  # when that launch returned
    finished_id: int = -1  # the last step rank 0 collected
    finish_call_ns: int = 0  # when it began waiting for it
    finish_return_ns: int = 0  # when it had it (the device was done with it)
    gap_ns: int = -1  # rank 0's device idle right before that step began; -1 unknown
    device_ns: int = -1  # rank 0's device time of that step (its all-reduces' waits for peers included)
    _prev_end: object = None  # CUDA event at the end of the step before it

    def meta(self, batch_id: int) -> tuple[int, ...]:
        return (batch_id, self.prev_id, self.prev_launched_ns, self.finished_id, self.finish_call_ns,
                self.finish_return_ns, self.gap_ns, self.device_ns)

    def launched(self, batch_id: int) -> None:
        self.prev_id, self.prev_launched_ns = batch_id, time.monotonic_ns()

    def finished(self, launched: object, call_ns: int) -> None:
        self.finished_id = getattr(launched, "batch_id", -1)
        self.finish_call_ns, self.finish_return_ns = call_ns, time.monotonic_ns()
        events = getattr(launched, "events", None)
        if not events:  # nothing timed (a verify step, an idle one): no gap across it
            self._prev_end, self.gap_ns, self.device_ns = None, -1, -1
            return
        try:  # all complete: finish_batch waited for a copy queued after this step's end event
            self.device_ns = int(events[0].elapsed_time(events[1]) * 1e6)
            self.gap_ns = -1 if self._prev_end is None else max(0, int(self._prev_end.elapsed_time(events[0]) * 1e6))
        except RuntimeError:
            self.gap_ns = self.device_ns = -1
        self._prev_end = events[1]
