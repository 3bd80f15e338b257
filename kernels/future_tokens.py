"""FutureTokens: a step's input ids with the overlap scheduler's placeholders resolved on the device.

With overlap scheduling a request's next input id may not be known on the host yet: the scheduler sends
-(r + 1) for "the token just sampled for request row r", which the worker keeps in a device buffer. The
torch form (lt, neg, sub, clamp, gather, where) is six launches per step; on CUDA this is one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_fusion import decode_fusion_enabled

_BLOCK = 1024


# Eager before every decode step: n (the step's token count) stays unspecialized, so one compile serves
# every batch size (Triton would compile again for n == 1 and for multiples of 16).
@triton.jit(do_not_specialize=("n",))
def _resolve_kernel(Ids, Future, Out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ids = tl.load(Ids + offs, mask=mask, other=0)
    pending = ids < 0
    future = tl.load(Future + tl.maximum(-ids - 1, 0), mask=mask & pending, other=0)
    tl.store(Out + offs, tl.where(pending, future, ids), mask=mask)


def resolve_future_ids(ids: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
    """ids [T] int64 → a new [T] tensor: ids[t] where >= 0, else future[-ids[t] - 1]. One launch on CUDA
    (the torch form elsewhere, and with SHOAL_DECODE_FUSION=0: it is outside the graphs, read per step)."""
    if not ids.is_cuda or not decode_fusion_enabled():
        return resolve_future_ids_ref(ids, future)
    return resolve_future_ids_kernel(ids, future)


def resolve_future_ids_ref(ids: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
    return torch.where(ids < 0, future[(-ids - 1).clamp_(min=0)], ids)


def resolve_future_ids_kernel(ids: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
    """The kernel on any device (the Triton interpreter on CPU: tests)."""
    out = torch.empty_like(ids)
    if ids.numel():
        _resolve_kernel[(triton.cdiv(ids.numel(), _BLOCK),)](ids, future, out, ids.numel(), BLOCK=_BLOCK)
    return out
