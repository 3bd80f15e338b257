"""SymmMemAllReduce: a one-shot all-reduce through torch symmetric memory for the small activations of a
CUDA-graph-captured decode step. Each rank copies its tensor into a buffer every peer can read over
NVLink, and one kernel sums all peers' copies. On 2x H200 it takes 7.5 µs per call inside a graph where
NCCL takes 18 µs (benchmarks/results/allreduce_2gpu.json), and a 32-layer decode step makes 64 calls.
Eagerly it is slower than NCCL (its barrier costs more than a launch), so it only runs under capture.

The ModelRunner turns it on for TP on CUDA with graphs (--disable-custom-all-reduce turns it off); Ray
TP ranks are made to see every GPU of their node, which the rendezvous needs. Two ranks' one-shot sum is
a + b as NCCL's is (tests/gpu/test_symm_mem_all_reduce_gpu.py checks exact equality).

Where this torch has one_shot_all_reduce_copy (2.8+), the kernel itself copies the local tensor into the
shared buffer, which saves the staging copy's launch: 64 kernels of a 32-layer TP decode step.
SHOAL_SYMM_MEM_COPY=0 keeps the separate copy (to measure one against the other).

add_rmsnorm() runs kernels/all_reduce_rmsnorm.py over the same buffer and a small symmetric flag area of
its own: the all-reduce, the residual add and the RMSNorm after it in one launch (the building block of a
TP decoder layer whose o_proj / down_proj leave their partial sums to the next norm). Llama-family models
use it by default; SHOAL_FUSED_AR_NORM=0 keeps the separate all-reduce and norm (to measure one against the
other; tests/gpu/test_all_reduce_rmsnorm_gpu.py checks the two give the same bits)."""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.distributed as dist

from kernels.all_reduce_rmsnorm import all_reduce_add_rmsnorm, flag_slots

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)  # what torch's one_shot_all_reduce kernel dispatches on
_PARTS = 3  # torch's staging part, then the fused kernel's two halves


class SymmMemAllReduce:
    def __init__(self, group_name: str, buffer: torch.Tensor, fused_copy: bool | None = None,
                 handle: object | None = None, flags: torch.Tensor | None = None, flags_handle: object | None = None):
        self.group_name = group_name
        # One symmetric allocation in three equal parts: torch's one-shot kernel stages in the first, our
        # fused kernel alternates between the other two (kernels/all_reduce_rmsnorm.py: it has no closing
        # barrier, so a peer may still read its previous call's part while torch's kernel runs).
        self.max_numel = buffer.numel() // _PARTS
        self.buffer = buffer[: self.max_numel]
        self.dtype = buffer.dtype
        # Every rank's buffer and flag area as device pointer arrays, for our own kernel; None without
        # rendezvous handles (tests that build one by hand).
        self.rank = self.world = 0
        self.buffer_ptrs = self.flag_ptrs = None
        self.fuse_norm = os.environ.get("SHOAL_FUSED_AR_NORM", "1") != "0"
        if handle is not None:
            self.rank, self.world = int(handle.rank), int(handle.world_size)
            self.buffer_ptrs = _peer_ptrs(buffer[self.max_numel:], handle)
            if flags is not None and flags_handle is not None:
                self.flag_ptrs = _peer_ptrs(flags, flags_handle)
        self.flags = flags  # kept alive: peers write into it
        if fused_copy is None:
            fused_copy = (hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy")
                          and os.environ.get("SHOAL_SYMM_MEM_COPY", "1") != "0")
        self.fused_copy = fused_copy

    @classmethod
    def create(cls, group: object, dtype: torch.dtype, device: torch.device,
               max_bytes: int) -> SymmMemAllReduce | None:
        """Collective over `group`: every rank gets one, or every rank gets None (then NCCL does it all).
        None when this torch, device or topology cannot (no peer access, a rank seeing another's GPU...).
        The ranks agree before the (collective) rendezvous, so one rank lacking the basics never leaves the
        others waiting in it; a rendezvous that fails on one rank only can still stall the rest."""
        buffer, flags, name = None, None, ""
        if device.type == "cuda" and dtype in SUPPORTED_DTYPES and torch.cuda.get_device_capability(device)[0] >= 9:
            try:
                import torch.distributed._symmetric_memory as symm_mem

                name = group.group_name  # type: ignore[attr-defined]
                if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9, deprecated after
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", FutureWarning)
                        symm_mem.enable_symm_mem_for_group(name)
                buffer = symm_mem.empty(_PARTS * max(max_bytes // dtype.itemsize, 1), dtype=dtype, device=device)
                world = dist.get_world_size(group)
                flags = symm_mem.empty(flag_slots(world), dtype=torch.int64, device=device).zero_()
                torch.cuda.synchronize(device)  # zero before any peer can write an arrival (agreed below)
            except Exception as e:  # a capability this machine lacks: say why, fall back to NCCL
                buffer = flags = None
                logger.warning("symmetric-memory all-reduce unavailable, using NCCL: %s", e)
        if not _all_agree(buffer is not None, group, device):
            return None
        try:
            handle = symm_mem.rendezvous(buffer, name)
            made = cls(name, buffer, handle=handle, flags=flags, flags_handle=symm_mem.rendezvous(flags, name))
        except Exception as e:
            logger.warning("symmetric-memory rendezvous failed, using NCCL: %s", e)
            made = None
        if not _all_agree(made is not None, group, device):
            return None
        # Every rank must take the same path at each norm (one fused launch meets the others' in its barrier,
        # an NCCL all-reduce would wait forever for it): the switch counts only where all ranks set it.
        made.fuse_norm = _all_agree(made.fuse_norm, group, device)
        return made

    def can_run(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.dtype and x.numel() <= self.max_numel and x.is_contiguous()
                and torch.cuda.is_current_stream_capturing())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        staged = self.buffer[:n]
        if self.fused_copy:
            return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x.view(-1), "sum",
                                                               self.group_name).view(x.shape)
        staged.copy_(x.view(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name).view(x.shape)

    def can_add_rmsnorm(self, x: torch.Tensor) -> bool:
        """Whether add_rmsnorm should take x: switched on, a flag area, what can_run asks, 2-D rows. A
        row-parallel linear and the norm after it both ask it of the same tensor, so they agree."""
        return self.fuse_norm and self.flag_ptrs is not None and x.dim() == 2 and self.can_run(x)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
        """rmsnorm(residual + all-reduced x) * weight, residual updated in place (None: the norm of the
        sum). Collective; call only where can_add_rmsnorm(x) holds on every rank."""
        assert self.buffer_ptrs is not None and self.flag_ptrs is not None
        return all_reduce_add_rmsnorm(x, residual, weight, eps, self.buffer_ptrs, self.flag_ptrs,
                                      self.rank, self.world, self.max_numel)


def _peer_ptrs(t: torch.Tensor, handle: object) -> torch.Tensor:
    """Every rank's address of `t` (a view into a symmetric allocation: the offset is the same on every rank)."""
    offset = t.data_ptr() - int(handle.buffer_ptrs[int(handle.rank)])  # type: ignore[attr-defined]
    return torch.tensor([int(p) + offset for p in handle.buffer_ptrs], dtype=torch.int64,  # type: ignore[attr-defined]
                        device=t.device)


def _all_agree(ok: bool, group: object, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return int(flag.item()) == 1
