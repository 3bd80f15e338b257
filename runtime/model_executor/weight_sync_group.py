"""WeightSyncGroup: one TP rank's membership of a trainer's process group, over which the trainer (rank 0)
broadcasts new weights (SGLang's init_weights_update_group / update_weights_from_distributed, the way
OpenRLHF, veRL and slime push weights to a rollout server without touching the disk).

The group is built the way the trainers build theirs (SGLang's init_custom_process_group, which they copy):
a TCPStore reached through torch.distributed.rendezvous at tcp://master_address:master_port (the trainer's
rank 0 serves it), then the same store prefixes torch's _new_process_group_helper adds
(<group_name>, <group_name>/, then cpu/ for gloo or cuda/ for nccl), so each side's collectives meet. Unlike
theirs, the ProcessGroupGloo / ProcessGroupNCCL is constructed directly: nothing is registered in
torch.distributed's global state and no default group is needed, so the TP group of this server (when there
is one) is never touched, never split from, and the group's name may be anything.

receive() posts one broadcast per tensor (in the request's order, all at once, as SGLang) into fresh tensors
(the device for nccl, host memory for gloo: the model's loaders copy them into place) and waits for all.
NCCL's work.wait() only orders the current CUDA stream after the broadcast (the CPU returns at once), so an
nccl receive polls work.is_completed() until timeout_s instead: the reply then means the data arrived, and
a dead trainer ends in an aborted group rather than a GPU stalled until NCCL's watchdog kills the process.
Any failure while receiving (an allocation, the trainer died, the timeout passed) leaves the stream at an
unknown position: the group is closed then, and the trainer must join a new one."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol

import torch
from torch.distributed import BroadcastOptions, PrefixStore, rendezvous

from runtime.admin_messages import DistributedWeights, WeightSyncInit
from runtime.errors import WeightLoadError

logger = logging.getLogger(__name__)


class WeightSyncGroup:
    def __init__(self, init: WeightSyncInit, rank: int, device: torch.device):
        """Joins the group as `rank`; returns once every member has (the trainer's rank 0 included), or
        raises WeightLoadError naming why not (nobody answered at the address within timeout_s, say)."""
        self.name, self.rank, self.world_size = init.group_name, rank, init.world_size
        if init.backend == "nccl" and device.type != "cuda":
            raise WeightLoadError(f"backend 'nccl' needs a CUDA device; this rank runs on {device}: use 'gloo'")
        self.device = device if init.backend == "nccl" else torch.device("cpu")
        self.lock = threading.Lock()  # a receive and a close never overlap
        self.timeout_s = init.timeout_s
        try:
            timeout = timedelta(seconds=init.timeout_s)
            store, _, _ = next(rendezvous(f"tcp://{_host(init.master_address)}:{init.master_port}", rank,
                                          init.world_size, timeout=timeout))
            store.set_timeout(timeout)
            store = PrefixStore(f"{'cuda' if init.backend == 'nccl' else 'cpu'}/",
                                PrefixStore(f"{self.name}/", PrefixStore(self.name, store)))
            self.pg = _process_group(init.backend, store, rank, init.world_size, timeout)
        except (RuntimeError, ValueError, OverflowError) as e:  # DistStoreError, a refused connection, a bad address
            raise WeightLoadError(f"could not join weight update group {self.name!r} at {init.master_address}:"
                                  f"{init.master_port} as rank {rank} of {init.world_size}: {e}") from None

    def receive(self, update: DistributedWeights) -> list[tuple[str, torch.Tensor]]:
        """The trainer's broadcast of update's tensors, in its order. WeightLoadError (the group closed) if
        it fails."""
        with self.lock:
            if self.pg is None:
                raise WeightLoadError(f"weight update group {self.name!r} is closed (a receive failed): "
                                      "destroy_weights_update_group, then init_weights_update_group again")
            try:  # everything: a tensor not allocated (OOM) is a broadcast left unread, as much as a dead trainer
                tensors = [torch.empty(shape, dtype=sync_dtype(dtype), device=self.device)
                           for dtype, shape in zip(update.dtypes, update.shapes)]
                opts = BroadcastOptions()
                opts.rootRank, opts.rootTensor = 0, 0
                works = [self.pg.broadcast([t], opts) for t in tensors]
                if self.device.type == "cuda":
                    wait_completed(works, self.timeout_s)
                for work in works:  # nccl: done already (raises its error, if any); gloo: waits up to timeout_s
                    work.wait()
            except Exception as e:
                self._close(abort=True)
                raise WeightLoadError(f"receiving the broadcast over weight update group {self.name!r} failed "
                                      f"({type(e).__name__}: {e}); the group is closed: the trainer must init a "
                                      "new one") from None
        return list(zip(update.names, tensors))

    def close(self) -> None:
        """Leaves the group (its connections close: a trainer still broadcasting over it gets an error)."""
        with self.lock:
            self._close()

    def _close(self, abort: bool = False) -> None:
        """abort: a collective may still be in flight (nccl's comm aborts instead of waiting for it)."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        end = (getattr(pg, "abort", None) if abort else None) or getattr(pg, "shutdown", None)
        try:
            if end is not None:
                end()
        except RuntimeError as e:  # already broken: closing it is all that was asked
            logger.warning("closing weight update group %r: %s", self.name, e)


class Work(Protocol):
    def is_completed(self) -> bool: ...

    def wait(self) -> bool: ...


def wait_completed(works: Sequence[Work], timeout_s: float, clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> None:
    """Returns once every work is completed (the data is on the device, or the work failed: its wait() raises
    then); TimeoutError after timeout_s. Polls from 0.1 ms up to 10 ms apart: an update's last tensor lands
    within a poll, and an idle wait costs next to no CPU."""
    deadline, pause = clock() + timeout_s, 1e-4
    pending = list(works)
    while pending := [w for w in pending if not w.is_completed()]:
        if clock() >= deadline:
            raise TimeoutError(f"{len(pending)} of {len(works)} tensors not received within timeout_s {timeout_s}")
        sleep(pause)
        pause = min(pause * 2, 0.01)


def sync_dtype(name: str) -> torch.dtype:
    """A trainer's dtype name ("bfloat16" or "torch.bfloat16") as torch's."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightLoadError(f"unknown dtype {name!r}")
    return dtype


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address  # IPv6 in a URL


def _process_group(backend: str, store: PrefixStore, rank: int, size: int, timeout: timedelta):
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        return ProcessGroupGloo(store, rank, size, timeout)
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    return ProcessGroupNCCL(store, rank, size, opts)
