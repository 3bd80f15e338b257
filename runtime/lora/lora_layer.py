"""LoraDelta: the LoRA term of one (possibly fused, possibly tensor-parallel) linear layer for every adapter
slot at once: y += ((x A^T) * mask) B^T.

A holds, per slot, `subs` blocks of max_rank rows (q, k, v of a fused qkv: each sub-projection has its own
A); B is block-diagonal over them, each block writing its sub-projection's output rows. Unused rows and
columns are zeros, so a rank below max_rank, an untargeted sub-projection or an empty slot add exactly 0.
Fixed shapes, no gather by token: CUDA-graph safe, and the prefill never materialises per-token matrices.

Tensor parallel: a column-parallel layer keeps this rank's output rows of B (the layer's own weight loader
slices them); a row-parallel layer keeps this rank's input columns of A, and its partial sums join the
layer's all-reduce (the caller adds the term before reducing).

Quantized bases (FP8, 4-bit): the buffers are in the activation dtype (the LoraBatch's), sized by the
projection's logical shape (lora_attach.logical_shape: a packed 4-bit weight has other dims), and the
term runs on the unquantized input (runtime/lora/lora_attach.py wraps the quantized forward)."""

from __future__ import annotations

import torch
from torch import nn

from runtime.lora.lora_batch import LoraBatch


class LoraDelta:
    def __init__(self, layer: nn.Module, batch: LoraBatch, subs: int, max_loras: int, max_rank: int,
                 row_parallel: bool, shape: tuple[int, int] | None = None):
        """shape: the projection's (outputs, inputs) on this rank; None: its dense weight's."""
        out_local, in_local = shape or layer.weight.shape
        dtype, device = batch.dtype, batch.slot_ids.device
        self.layer, self.batch, self.row_parallel = layer, batch, row_parallel
        self.max_loras, self.max_rank, self.per_slot = max_loras, max_rank, subs * max_rank
        self.a = torch.zeros(max_loras * self.per_slot, in_local, dtype=dtype, device=device)
        self.b = torch.zeros(out_local, max_loras * self.per_slot, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ self.a.t()
        h = (h.view(x2.shape[0], self.max_loras, self.per_slot) * self.batch.mask[:, :, None]).view(x2.shape[0], -1)
        return torch.addmm(y.reshape(-1, y.shape[-1]), h, self.b.t()).view(y.shape)

    def load(self, slot: int, sub: int, shard_id: object, a: torch.Tensor, b: torch.Tensor) -> None:
        """Writes one sub-projection's (full, unsharded) A [r, in] and scaled B [out, r] into `slot` (1..)."""
        a_local, b_local = self.shard(shard_id, a, b)
        col = (slot - 1) * self.per_slot + sub * self.max_rank
        self.a[col:col + a.shape[0]].copy_(a_local)
        self.b[:, col:col + a.shape[0]].copy_(b_local)

    def shard(self, shard_id: object, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of A and B (host tensors), as load() writes them; ValueError (or the layer's
        WeightLoadError) where the adapter's shapes are not the base projection's. Writes no device memory,
        so it checks an adapter loaded while requests run."""
        r = a.shape[0]
        if r > self.max_rank or b.shape[1] != r:
            raise ValueError(f"rank {r} does not fit the LoRA buffers' rank {self.max_rank}")
        loader = self.layer.weight_loader
        if self.row_parallel:  # A by input columns, like the weight; B whole
            a_local = torch.empty(r, self.a.shape[1], dtype=a.dtype)
            loader(a_local, a, shard_id)
            b_local = b
        else:  # B by output rows, into the sub-projection's rows of the fused output
            a_local = a
            b_local = torch.zeros(self.b.shape[0], r, dtype=b.dtype)
            loader(b_local, b, shard_id)
        if a_local.shape[1] != self.a.shape[1] or b_local.shape[0] != self.b.shape[0]:
            raise ValueError(f"lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the projection "
                             f"({self.a.shape[1]} inputs, {self.b.shape[0]} outputs on this rank)")
        return a_local, b_local

    def clear(self, slot: int) -> None:
        cols = slice((slot - 1) * self.per_slot, slot * self.per_slot)
        self.a[cols].zero_()
        self.b[:, cols].zero_()
