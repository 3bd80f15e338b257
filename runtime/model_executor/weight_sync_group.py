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
A failure while receiving (the trainer died, the timeout passed) leaves the stream at an unknown position:
the group is closed then, and the trainer must join a new one."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

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
        timeout = timedelta(seconds=init.timeout_s)
        try:
            store, _, _ = next(rendezvous(f"tcp://{_host(init.master_address)}:{init.master_port}", rank,
                                          init.world_size, timeout=timeout))
            store.set_timeout(timeout)
            store = PrefixStore(f"{'cuda' if init.backend == 'nccl' else 'cpu'}/",
                                PrefixStore(f"{self.name}/", PrefixStore(self.name, store)))
            self.pg = _process_group(init.backend, store, rank, init.world_size, timeout)
        except (RuntimeError, ValueError) as e:  # DistStoreError, a refused connection, a bad address
            raise WeightLoadError(f"could not join weight update group {self.name!r} at {init.master_address}:"
                                  f"{init.master_port} as rank {rank} of {init.world_size}: {e}") from None

    def receive(self, update: DistributedWeights) -> list[tuple[str, torch.Tensor]]:
        """The trainer's broadcast of update's tensors, in its order. WeightLoadError (the group closed) if
        it fails."""
        with self.lock:
            if self.pg is None:
                raise WeightLoadError(f"weight update group {self.name!r} is closed")
            tensors = [torch.empty(shape, dtype=sync_dtype(dtype), device=self.device)
                       for dtype, shape in zip(update.dtypes, update.shapes)]
            opts = BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            try:
                for work in [self.pg.broadcast([t], opts) for t in tensors]:
                    work.wait()
            except RuntimeError as e:
                self._close()
                raise WeightLoadError(f"receiving the broadcast over weight update group {self.name!r} failed "
                                      f"({e}); the group is closed: the trainer must init a new one") from None
        return list(zip(update.names, tensors))

    def close(self) -> None:
        """Leaves the group (its connections close: a trainer still broadcasting over it gets an error)."""
        with self.lock:
            self._close()

    def _close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError as e:  # already broken: closing it is all that was asked
                logger.warning("closing weight update group %r: %s", self.name, e)


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
