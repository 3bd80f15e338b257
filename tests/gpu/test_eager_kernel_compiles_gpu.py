"""The kernels that run eagerly before every decode step (the graph replay's input staging, the overlap
scheduler's placeholder ids) compile once for every batch size: their sizes are left unspecialized and
their sources (views of the step's packed copy) always 16-byte aligned, so a new batch size never
JIT-compiles in the middle of serving (a Ray TP=2 bench's first batch-32 steps stalled ~120 ms on both
ranks)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.triton_compiles import TritonCompiles
from kernels.future_tokens import resolve_future_ids_kernel
from kernels.graph_inputs import stage_graph_inputs
from runtime.host_to_device import to_device_fields

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton compiles for the device)"),
]

SIZES = [(1, 1), (2, 2), (3, 4), (5, 8), (16, 16), (17, 24), (32, 32), (33, 40)]


def _step(bs: int, padded: int, forms: tuple[str, ...] = ("plain", "unstaged", "staged")) -> None:
    # the step's index tensors as ForwardBatch makes them: views of one packed copy
    fields = [list(range(f * bs, (f + 1) * bs)) for f in range(6)] + [[-(i % 7) - 1 for i in range(bs)]]
    ids, pos, loc, rpi, sl, pl, placeholders = to_device_fields(fields, torch.int64, torch.device("cuda"))
    dst = tuple(torch.zeros(64, device="cuda", dtype=torch.int64) for _ in range(6))
    future = torch.arange(100, 164, device="cuda", dtype=torch.int64)
    table = torch.zeros(4 * 40, 1025, device="cuda", dtype=torch.int32)  # rows up to 4 * bs
    rows = torch.zeros(64, device="cuda", dtype=torch.int64)
    if "plain" in forms:  # a caller without a table
        stage_graph_inputs(dst, (ids, pos, loc, rpi, sl, pl), bs, padded, 1, 1)
        assert torch.equal(dst[0][:bs], ids) and bool((dst[2][bs:padded] == 0).all())
    if "unstaged" in forms:  # CudaGraphRunner's other replays (TARGET_VERIFY, a draft model's DECODE)
        stage_graph_inputs(dst, (ids, pos, loc, rpi, sl, pl), bs, padded, 1, 1, req_to_token=table,
                           write_table=False, rows=rows, scratch_row=63)
        assert not table.any() and bool((rows[bs:padded] == 63).all())
    if "staged" in forms:  # the decode replay's: placeholders resolved, token table written, tail rows filled
        stage_graph_inputs(dst, (placeholders, pos, loc, rpi, sl, pl), bs, padded, 1, 1, future=future,
                           req_to_token=table, rows=rows, scratch_row=63)
        assert torch.equal(dst[0][:bs], future[torch.arange(bs, device="cuda") % 7])
        assert torch.equal(table[rpi, pos], loc.to(torch.int32)) and bool((rows[bs:padded] == 63).all())
    want = future[torch.arange(bs, device="cuda") % 7]
    assert torch.equal(resolve_future_ids_kernel(placeholders, future), want)


def test_one_compile_serves_every_batch_size() -> None:
    # Compiles both kernels once, the staging kernel in its decode form only: its other forms (a table
    # not written, or none) must reuse that variant (a pointer of another dtype would compile another).
    _step(7, 8, forms=("staged",))
    with TritonCompiles() as compiles:
        for bs, padded in SIZES:
            _step(bs, padded)
        torch.cuda.synchronize()
    assert compiles.kernels == [], compiles.kernels
