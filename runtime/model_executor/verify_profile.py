"""VerifyProfile: where one TARGET_VERIFY step's time went, so a benchmark can tell the graph from the
host work around it. Host spans come from perf_counter marks; device spans from CUDA events recorded
between the phases (zero on CPU). Recording costs four events per step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from runtime.model_executor.forward_batch import ForwardBatch


@dataclass(slots=True)
class VerifyProfile:
    batch_size: int
    tokens: int
    graph: bool  # the target forward replayed a CUDA graph
    prep_ms: float  # host: step start → verify (ForwardBatch build, its H2D copy, token table write)
    draft_host_ms: float = 0.0  # host: the draft model's steps (STANDALONE), launches and syncs
    target_launch_ms: float = 0.0  # host: enqueueing the target forward (graph replay + input copies)
    sample_launch_ms: float = 0.0  # host: enqueueing the sampling
    wait_ms: float = 0.0  # host blocked on the device→host copy of the tokens
    accept_ms: float = 0.0  # host: acceptance and the result, after the copy
    wall_ms: float = 0.0  # step start → result
    draft_ms: float = 0.0  # device spans (CUDA events)
    target_ms: float = 0.0
    sample_ms: float = 0.0
    _t: float = 0.0
    _t0: float = 0.0
    _events: list[Any] = field(default_factory=list)

    @classmethod
    def start(cls, fb: ForwardBatch, t0: float, device: torch.device, graphs: Any) -> VerifyProfile:
        now = time.perf_counter()
        p = cls(fb.batch_size, fb.extend_num_tokens, graphs is not None and graphs.can_run(fb), 1000 * (now - t0),
                _t=now, _t0=t0)
        if device.type == "cuda":
            p._events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            p._events[0].record()
        return p

    def _lap(self, i: int) -> float:
        if self._events:
            self._events[i].record()
        now = time.perf_counter()
        ms, self._t = 1000 * (now - self._t), now
        return ms

    def mark_draft(self) -> None:
        """Called whether or not a draft model ran, so the device spans stay in order."""
        self.draft_host_ms = self._lap(1)

    def mark_forward(self) -> None:
        self.target_launch_ms = self._lap(2)

    def mark_sample(self) -> None:
        self.sample_launch_ms = self._lap(3)

    def mark_synced(self) -> None:
        now = time.perf_counter()
        self.wait_ms, self._t = 1000 * (now - self._t), now

    def device_s(self) -> float:
        if not self._events:
            return 0.0
        return self._events[0].elapsed_time(self._events[3]) / 1e3

    def finish(self) -> VerifyProfile:
        now = time.perf_counter()
        self.accept_ms, self.wall_ms = 1000 * (now - self._t), 1000 * (now - self._t0)
        if self._events:
            e = self._events
            self.draft_ms, self.target_ms, self.sample_ms = (e[0].elapsed_time(e[1]), e[1].elapsed_time(e[2]),
                                                             e[2].elapsed_time(e[3]))
            self._events = []
        return self

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__ if not k.startswith("_")}
