"""apply_token_bitmask: a grammar's allowed tokens, as an int32 bitmask per constrained row, applied to the
logits of the whole batch on their device in a few vectorized ops (no per-row loop, no host sync), so
constrained and free rows share one batch and one sampling pass."""

from __future__ import annotations

import numpy as np
import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab]: bit t % 32 of word t // 32 is token t's "allowed" flag (xgrammar's layout)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: the sign bit is masked off by & 1
    flat = bits.reshape(bitmask.shape[0], -1).bool()
    if flat.shape[1] >= vocab:
        return flat[:, :vocab]
    # Logits wider than the grammar's vocabulary (padded embeddings): those columns are never allowed.
    return torch.cat([flat, flat.new_zeros(flat.shape[0], vocab - flat.shape[1])], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf wherever bitmask[i] disallows t."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    sub = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)


def bitmask_from_bytes(data: bytes, rows: int, device: torch.device) -> torch.Tensor:
    """The int32 [rows, words] mask a SamplingBatch carries as bytes, on device. One host copy: the bytes
    go straight into a pinned buffer (torch's host allocator keeps it until the copy is done), whose copy
    to the device is asynchronous — a pageable one would wait for the stream to drain."""
    src = np.frombuffer(data, dtype=np.int32).reshape(rows, -1)  # a view of the bytes, no copy
    if device.type == "cuda":
        pinned = torch.empty(src.shape, dtype=torch.int32, pin_memory=True)
        pinned.numpy()[...] = src
        return pinned.to(device, non_blocking=True)
    return torch.from_numpy(src.copy())  # writable: torch refuses to wrap read-only memory silently
