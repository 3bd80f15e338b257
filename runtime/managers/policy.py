"""SchedulePolicy: the order in which waiting requests are considered for prefill."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from runtime.managers.req import Req

if TYPE_CHECKING:
    from runtime.managers.priority import PriorityScheduling


class SchedulePolicy(ABC):
    @abstractmethod
    def order(self, waiting: list[Req], prefix_len: Callable[[Req], int]) -> list[Req]: ...


class FCFSPolicy(SchedulePolicy):
    def order(self, waiting: list[Req], prefix_len: Callable[[Req], int]) -> list[Req]:
        return waiting  # the queue is kept in arrival order (retracted requests go back to the front)


class LongestPrefixMatchPolicy(SchedulePolicy):
    """Longest cached prefix first, so requests that share a prefix run while it is still cached.
    Falls back to FCFS for long queues, where matching every request would cost more than it saves."""

    max_queue_for_matching = 128

    def order(self, waiting: list[Req], prefix_len: Callable[[Req], int]) -> list[Req]:
        if len(waiting) > self.max_queue_for_matching:
            return waiting
        keyed = [(-prefix_len(r), i, r) for i, r in enumerate(waiting)]
        keyed.sort(key=lambda t: (t[0], t[1]))
        return [r for _, _, r in keyed]


class LongestOutputFirstPolicy(SchedulePolicy):
    """Largest max_new_tokens first (SGLang's lof): when a burst arrives at once, the requests that set the
    run's length start decoding first, which shortens the whole burst when their decodes ride along with
    the later prefill chunks (--enable-mixed-chunk). Ties keep arrival order."""

    def order(self, waiting: list[Req], prefix_len: Callable[[Req], int]) -> list[Req]:
        return sorted(waiting, key=lambda r: -r.params.max_new_tokens)  # sorted() is stable


class ByPriority(SchedulePolicy):
    """Priority scheduling: the better rank first (PriorityScheduling.rank); within a rank, the order of the
    policy it wraps."""

    def __init__(self, within: SchedulePolicy, priority: PriorityScheduling):
        self.within, self.priority = within, priority

    def order(self, waiting: list[Req], prefix_len: Callable[[Req], int]) -> list[Req]:
        return self.priority.order(self.within.order(waiting, prefix_len))


POLICIES = ("fcfs", "lpm", "lof")


def create_policy(name: str, cache_enabled: bool, priority: PriorityScheduling | None = None) -> SchedulePolicy:
    policy = _create(name, cache_enabled)
    return policy if priority is None else ByPriority(policy, priority)


def _create(name: str, cache_enabled: bool) -> SchedulePolicy:
    if name == "lpm" and cache_enabled:
        return LongestPrefixMatchPolicy()
    if name == "lof":
        return LongestOutputFirstPolicy()
    if name in ("fcfs", "lpm"):
        return FCFSPolicy()
    raise ValueError(f"unknown schedule policy {name!r}; known: {', '.join(POLICIES)}")
