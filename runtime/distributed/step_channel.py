"""StepChannel: rank 0's bytes for each step, delivered to every other rank of its TP group.

The scheduler lives in rank 0's process (SGLang's shape): each step it broadcasts the encoded
WorkerBatch over a gloo group of its own, so a step costs no RPC. Messages up to HEADER_BYTES - 8 travel
in one fixed-size broadcast; longer ones (large prefills) in a second one. The group's timeout is
effectively unbounded because an idle replica's peers wait in recv() for as long as it idles — blocked
in a socket read, not spinning a core. A dead peer still surfaces at once: its socket closes."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

HEADER_BYTES = 4096
_IDLE_TIMEOUT = datetime.timedelta(days=365)


class StepChannel:
    def __init__(self, group: object, rank: int):
        self.group, self.rank = group, rank
        self._buf = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        self._len = self._buf[:8].view(torch.int64)

    @classmethod
    def create(cls, rank: int, ranks: list[int] | None = None) -> StepChannel:
        """Collective over the default process group: every rank calls it, in the same order."""
        return cls(dist.new_group(ranks, backend="gloo", timeout=_IDLE_TIMEOUT), rank)

    def send(self, data: bytes) -> None:
        """Rank 0: broadcasts one message."""
        n = len(data)
        head = min(n, HEADER_BYTES - 8)
        self._len[0] = n
        if head:
            self._buf[8:8 + head] = torch.frombuffer(bytearray(data[:head]), dtype=torch.uint8)
        dist.broadcast(self._buf, group_src=0, group=self.group)
        if n > head:
            dist.broadcast(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8), group_src=0, group=self.group)

    def recv(self) -> bytes:
        """Other ranks: the next message."""
        dist.broadcast(self._buf, group_src=0, group=self.group)
        n = int(self._len[0])
        head = min(n, HEADER_BYTES - 8)
        data = self._buf[8:8 + head].numpy().tobytes()
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8)
            dist.broadcast(rest, group_src=0, group=self.group)
            data += rest.numpy().tobytes()
        return data
