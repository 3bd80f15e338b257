"""GlooStepChannel: a StepChannel over a gloo group — TCP, so it spans nodes. Messages up to
HEADER_BYTES less the frame header travel in one fixed-size broadcast; longer ones (large prefills) in
a second one. A reader waits in a socket read (no busy core); a dead peer surfaces at once (its socket
closes)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from runtime.distributed.step_channel import StepChannel
from runtime.distributed.step_frame import META_SLOTS, StepFrame

HEADER_BYTES = 4096
_HEAD_INTS = 2 + META_SLOTS  # length, send time, meta
_PAYLOAD = HEADER_BYTES - 8 * _HEAD_INTS


class GlooStepChannel(StepChannel):
    kind = "gloo"

    def __init__(self, group: object, rank: int):
        self.group, self.rank = group, rank
        self._buf = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        self._head = self._buf[:8 * _HEAD_INTS].view(torch.int64)

    def send(self, data: bytes, meta: tuple[int, ...] = ()) -> None:
        n = len(data)
        first = min(n, _PAYLOAD)
        self._head[:] = torch.tensor([n, time.monotonic_ns(), *meta, *(0,) * (META_SLOTS - len(meta))])
        if first:
            self._buf[8 * _HEAD_INTS:8 * _HEAD_INTS + first] = torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8)
        dist.broadcast(self._buf, group_src=0, group=self.group)
        if n > first:
            dist.broadcast(torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8), group_src=0, group=self.group)

    def recv(self) -> StepFrame:
        dist.broadcast(self._buf, group_src=0, group=self.group)
        n, sent_ns, *meta = self._head.tolist()
        first = min(n, _PAYLOAD)
        data = self._buf[8 * _HEAD_INTS:8 * _HEAD_INTS + first].numpy().tobytes()
        if n > first:
            rest = torch.empty(n - first, dtype=torch.uint8)
            dist.broadcast(rest, group_src=0, group=self.group)
            data += rest.numpy().tobytes()
        return StepFrame(data, sent_ns, tuple(meta))
