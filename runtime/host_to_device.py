"""to_device: small host lists onto the device without a stream sync (used by the sampler, ForwardBatch
and the ModelRunner alike, so it sits below all three); to_device_fields: several in one copy."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a stream sync (a copy from pageable memory waits for
    the stream to drain, which would stall overlap scheduling behind the batch in flight)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def to_device_fields(fields: Sequence[list[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Several small host lists in one copy, as views that each start on a 16-byte boundary (a field is
    padded to a whole number of 16 bytes). Triton specializes a kernel on its pointers' 16-byte alignment:
    views at offsets that follow the step's sizes (a batch size's parity, for int64) would make each new
    pattern a JIT compile in the middle of serving, in every kernel that reads them."""
    align = max(1, 16 // dtype.itemsize)
    flat: list[int] = []
    offsets = []
    for f in fields:
        offsets.append(len(flat))
        flat.extend(f)
        flat.extend([0] * (-len(f) % align))
    t = to_device(flat, dtype, device)
    return [t.narrow(0, o, len(f)) for o, f in zip(offsets, fields, strict=True)]
