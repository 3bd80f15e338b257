"""to_device: small host lists onto the device without a stream sync (used by the sampler, ForwardBatch
and the ModelRunner alike, so it sits below all three)."""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a stream sync (a copy from pageable memory waits for
    the stream to drain, which would stall overlap scheduling behind the batch in flight)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
