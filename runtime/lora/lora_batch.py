"""LoraBatch: which adapter slot each token of the running forward uses, as a [T, max_loras] 0/1 mask
every LoRA layer reads. Computed on the device from the slot tensor (no host sync, fixed shape), so a CUDA
graph captures it from its static slot buffer and recomputes it at each replay."""

from __future__ import annotations

import torch


class LoraBatch:
    def __init__(self, max_loras: int, dtype: torch.dtype, device: torch.device):
        self.slot_ids = torch.arange(1, max_loras + 1, device=device)  # slot 0 is the base model: no column
        self.dtype = dtype
        self.mask = torch.zeros(0, max_loras, dtype=dtype, device=device)

    def prepare(self, token_slots: torch.Tensor) -> None:
        """token_slots: [T] int, each token's adapter slot (0 = none)."""
        self.mask = (token_slots[:, None] == self.slot_ids[None, :]).to(self.dtype)

    def prepare_base(self, num_tokens: int) -> None:
        self.mask = torch.zeros(num_tokens, self.slot_ids.numel(), dtype=self.dtype, device=self.slot_ids.device)
