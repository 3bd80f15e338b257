"""ReqToTokenPool: request rows are handed out once, returned once, and hold the KV slots written to them."""

from __future__ import annotations

import pytest
import torch

from runtime.errors import DoubleFreeError
from runtime.mem_cache.req_to_token import ReqToTokenPool


def test_alloc_free_and_exhaustion() -> None:
    pool = ReqToTokenPool(4, 32)
    rows = pool.alloc(3)
    assert rows is not None and len(set(rows)) == 3 and all(0 <= r < 4 for r in rows)
    assert pool.available_size() == 1
    assert pool.alloc(2) is None  # not enough rows: nothing is handed out
    assert pool.available_size() == 1
    last = pool.alloc(1)
    assert set(rows + last) == {0, 1, 2, 3}
    pool.free(rows[1])
    assert pool.available_size() == 1
    assert pool.alloc(1) == [rows[1]]


def test_double_free_raises() -> None:
    pool = ReqToTokenPool(2, 8)
    (row,) = pool.alloc(1)
    pool.free(row)
    with pytest.raises(DoubleFreeError, match=f"request slot {row}"):
        pool.free(row)
    free_before = pool.available_size()
    with pytest.raises(DoubleFreeError):
        pool.free(1 - row)  # never allocated
    assert pool.available_size() == free_before


def test_write_and_read_slots() -> None:
    pool = ReqToTokenPool(3, 16)
    row = pool.alloc(1)[0]
    pool.write(row, 0, torch.tensor([5, 6, 7]))
    pool.write(row, 3, torch.tensor([40, 41]))
    assert pool.read(row, 5).tolist() == [5, 6, 7, 40, 41]
    assert pool.read(row, 5, start=2).tolist() == [7, 40, 41]
    assert pool.read(row, 5).dtype == torch.int64
    assert pool.req_to_token[row, 5:].abs().sum() == 0  # nothing written past the end
