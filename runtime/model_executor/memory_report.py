"""MemoryReport: the start-up line that says how a rank's memory was split, as vLLM's "GPU KV cache size"
and SGLang's "KV Cache is allocated" lines do.

Why: an operator sizing `--mem-fraction-static`, `--max-running-requests` or `--context-length` needs the
pool's size in tokens and bytes, how many full-context requests it holds, and on a GPU what start-up left
free. On an H200 the default 0.85 left 19.4 GiB that a 1000 x 1000 run never touched, against 4.2 GiB of
activations, graphs and workspaces at their peak (benchmarks/README.md, fifteenth session): nothing said so
until a benchmark measured it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

GIB = 1024 ** 3
MIB = 1024 ** 2


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def size(nbytes: int) -> str:
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / MIB:.1f} MiB" if nbytes >= MIB else f"{nbytes / 1024:.1f} KiB"


@dataclass(frozen=True, slots=True)
class MemoryReport:
    pool_tokens: int
    pool_bytes: int
    kv_dtype: torch.dtype
    weight_bytes: int
    context_len: int
    free_bytes: int | None = None  # CUDA: free after the pool and graphs (None on CPU)
    total_bytes: int | None = None

    @staticmethod
    def of(pool_tokens: int, kv_buffers: list[torch.Tensor], kv_dtype: torch.dtype, model: torch.nn.Module,
           context_len: int, device: torch.device) -> MemoryReport:
        free = total = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            free, total = torch.cuda.mem_get_info(device)
        return MemoryReport(pool_tokens, tensor_bytes(kv_buffers), kv_dtype,
                            tensor_bytes(model.parameters()) + tensor_bytes(model.buffers()), context_len, free, total)

    def line(self) -> str:
        dtype = str(self.kv_dtype).removeprefix("torch.")
        out = (f"KV pool: {self.pool_tokens:,} tokens ({size(self.pool_bytes)}, {dtype}): "
               f"{self.pool_tokens / self.context_len:.2f} requests of the full {self.context_len:,}-token "
               f"context at once; weights {size(self.weight_bytes)}")
        if self.free_bytes is not None and self.total_bytes is not None:
            out += (f"; {size(self.free_bytes)} of {size(self.total_bytes)} free after start-up "
                    f"(activations take theirs from it; more pool: --mem-fraction-static)")
        return out
