"""check_priority_flags: ServerArgs' request-priority flags (SGLang's --enable-priority-scheduling and its
companions, vLLM's --scheduling-policy priority) checked together at start (runtime/config.py calls it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.errors import ServerArgsError
from runtime.server_flags import flag_name

if TYPE_CHECKING:
    from runtime.config import ServerArgs


def check_priority_flags(args: ServerArgs) -> None:
    threshold = args.priority_scheduling_preemption_threshold
    if threshold is not None and threshold < 0:  # a negative gap would let equals retract each other forever
        raise ServerArgsError("--priority-scheduling-preemption-threshold", f"must be >= 0, got {threshold}")
    if not args.priority_scheduling:
        for name in ("schedule_low_priority_values_first", "priority_scheduling_preemption_threshold"):
            if getattr(args, name) not in (False, None):
                raise ServerArgsError(flag_name(name), "needs --enable-priority-scheduling (vLLM: "
                                                          "--scheduling-policy priority)")
