"""ShmStepChannel: a StepChannel through a ShmRing, for a TP group whose ranks share a node. Rank 0 writes,
rank r reads as the ring's reader r - 1. Set up over the group's gloo group, which stays for the handshake
only: the ranks agree they are on one host, rank 0 makes the ring and sends its path, the others map it,
and rank 0 removes the file once all have (so a crash leaves nothing behind in /dev/shm)."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time

import torch.distributed as dist

from runtime.distributed import shm_ring
from runtime.distributed.shm_ring import ShmRing
from runtime.distributed.step_channel import StepChannel
from runtime.distributed.step_frame import StepFrame

logger = logging.getLogger(__name__)

RING_BYTES = 4 << 20  # a decode step is a few kB, a long prefill chunk ~100 kB; longer ones stream through


class ShmStepChannel(StepChannel):
    kind = "shm"

    def __init__(self, ring: ShmRing, rank: int):
        self.ring, self.rank = ring, rank

    @classmethod
    def create(cls, group: object, rank: int, world_size: int, required: bool = False,
               spin_s: float = 0.002) -> ShmStepChannel | None:
        """Collective over `group`: every rank gets a channel, or every rank gets None (use gloo). With
        `required`, None becomes a ValueError saying why."""
        here = [None] * world_size
        dist.all_gather_object(here, (_host_key(), shm_ring.usable()), group=group)
        why = ("ranks on more than one node" if len({h for h, _ in here}) > 1
               else "no usable /dev/shm with futexes on x86-64 Linux" if not all(ok for _, ok in here) else None)
        if why is not None:
            if required:
                raise ValueError(f"--step-channel shm needs every TP rank on one node: {why}")
            return None
        path, ring, error = [None], None, None
        try:
            if rank == 0:
                path[0] = f"/dev/shm/shoal-step-{os.getpid()}-{secrets.token_hex(4)}"
                ring = ShmRing.create(path[0], RING_BYTES, world_size - 1, spin_s=spin_s)
        except (OSError, ValueError) as e:  # no room in /dev/shm, more ranks than a ring serves
            path[0], error = None, e
        dist.broadcast_object_list(path, group_src=0, group=group)
        try:
            if rank > 0 and path[0] is not None:
                ring = ShmRing.attach(path[0], rank - 1, world_size - 1, spin_s=spin_s)
        except OSError as e:
            error = e
        oks = [None] * world_size
        dist.all_gather_object(oks, ring is not None, group=group)
        if rank == 0 and ring is not None:
            ring.unlink()
        if not all(oks):
            if required:
                raise ValueError(f"--step-channel shm: a rank could not map the ring ({error or 'another rank'})")
            logger.warning("shared-memory step channel unavailable, using gloo: %s", error or "another rank failed")
            return None
        return cls(ring, rank)

    def send(self, data: bytes, meta: tuple[int, ...] = ()) -> None:
        self.ring.write(data, time.monotonic_ns(), meta)

    def recv(self) -> StepFrame:
        return self.ring.read()

    def abort(self) -> None:
        self.ring.abort()


def _host_key() -> str:
    """Same string on two processes only when they share a kernel (so a /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
