"""The kernels that run eagerly before every decode step (the graph replay's input staging, the overlap
scheduler's placeholder ids) compile once for every batch size: their sizes and their sources' alignment
(slices of the step's packed copy) are left unspecialized, so a new batch size never JIT-compiles in the
middle of serving (a Ray TP=2 bench's first batch-32 steps stalled ~120 ms on both ranks)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.triton_compiles import TritonCompiles
from kernels.future_tokens import resolve_future_ids_kernel
from kernels.graph_inputs import stage_graph_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton compiles for the device)"),
]

SIZES = [(1, 1), (2, 2), (3, 4), (5, 8), (16, 16), (17, 24), (32, 32), (33, 40)]


def _step(bs: int, padded: int) -> None:
    flat = torch.arange(8 * bs, device="cuda", dtype=torch.int64)  # the step's packed copy, sliced
    ids, pos, loc, rpi, sl, pl, _, _ = flat.split([bs] * 8)
    dst = tuple(torch.zeros(64, device="cuda", dtype=torch.int64) for _ in range(6))
    stage_graph_inputs(dst, (ids, pos, loc, rpi, sl, pl), bs, padded, 1, 1)
    assert torch.equal(dst[0][:bs], ids) and bool((dst[2][bs:padded] == 0).all())
    future = torch.arange(100, 164, device="cuda", dtype=torch.int64)
    placeholders = (-(flat % 7) - 1).split([bs] * 8)[1]  # a slice at the second field's offset, like input ids'
    assert torch.equal(resolve_future_ids_kernel(placeholders, future), future[pos % 7])


def test_one_compile_serves_every_batch_size() -> None:
    _step(7, 8)  # compiles both kernels once
    with TritonCompiles() as compiles:
        for bs, padded in SIZES:
            _step(bs, padded)
        torch.cuda.synchronize()
    assert compiles.kernels == [], compiles.kernels
