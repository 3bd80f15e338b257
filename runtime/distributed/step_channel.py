"""StepChannel: rank 0's bytes for each step, delivered to every other rank of its TP group.

The scheduler lives in rank 0's process (SGLang's shape): each step it sends the encoded WorkerBatch to
the other ranks, so a step costs no RPC. Two kinds (create_step_channel picks, collectively):
  shm   a shared-memory ring in /dev/shm (ShmStepChannel): ranks on one node; a few µs a message
  gloo  a broadcast over a gloo group (GlooStepChannel): any nodes; a loopback send and wake-up a message
Neither spins a core while a replica idles: a gloo reader blocks in a socket read, a shm reader in a futex."""

from __future__ import annotations

import datetime
from abc import ABC, abstractmethod

import torch.distributed as dist

from runtime.distributed.step_frame import StepFrame

STEP_CHANNEL_KINDS = ("auto", "shm", "gloo")
# An idle replica's readers wait for as long as it idles; a dead peer still surfaces (socket closed, or
# the shm ring's liveness check).
IDLE_TIMEOUT = datetime.timedelta(days=365)


class StepChannel(ABC):
    kind: str

    @abstractmethod
    def send(self, data: bytes, meta: tuple[int, ...] = ()) -> None:
        """Rank 0: one message to every other rank, with up to META_SLOTS integers beside it."""

    @abstractmethod
    def recv(self) -> StepFrame:
        """Other ranks: the next message (blocks until it comes)."""

    def abort(self) -> None:
        """Rank 0, from any thread, once its group has failed: a send blocked on a dead reader gives up."""


def create_step_channel(rank: int, world_size: int, kind: str = "auto", spin_s: float = 0.002) -> StepChannel:
    """Collective over the default process group (every rank calls it, in the same order). kind "auto":
    shm when every rank is on this node and the platform allows, gloo otherwise; "shm" insists.
    spin_s: how long a shm reader spins before it sleeps (0 where the ranks compute on the CPU cores)."""
    from runtime.distributed.gloo_step_channel import GlooStepChannel
    from runtime.distributed.shm_step_channel import ShmStepChannel

    if kind not in STEP_CHANNEL_KINDS:
        raise ValueError(f"step channel {kind!r}: expected one of {', '.join(STEP_CHANNEL_KINDS)}")
    group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    if kind != "gloo":
        channel = ShmStepChannel.create(group, rank, world_size, required=kind == "shm", spin_s=spin_s)
        if channel is not None:
            return channel
    return GlooStepChannel(group, rank)
