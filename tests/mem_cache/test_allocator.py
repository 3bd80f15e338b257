"""KVAllocator: slot accounting holds under any alloc/free sequence; misuse is caught, not absorbed."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.errors import DoubleFreeError
from runtime.mem_cache.allocator import KVAllocator


def test_random_alloc_free_keeps_accounting() -> None:
    rng = random.Random(1234)
    alloc = KVAllocator(200)
    held: list[torch.Tensor] = []
    for _ in range(500):
        if held and rng.random() < 0.45:
            chunk = held.pop(rng.randrange(len(held)))
            alloc.free(chunk[torch.randperm(chunk.numel())])  # freeing order must not matter
        else:
            n = rng.randint(0, 30)
            got = alloc.alloc(n)
            if got is None:
                assert n > alloc.available_size()
                continue
            assert got.numel() == n
            held.append(got)
        in_use = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        assert alloc.available_size() + alloc.used_size() == alloc.size
        assert alloc.used_size() == in_use.numel()
        assert in_use.unique().numel() == in_use.numel()  # no slot handed out twice
        assert bool(((in_use >= 1) & (in_use <= alloc.size)).all())  # slot 0 never handed out


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    alloc = KVAllocator(8)
    first = alloc.alloc(6)
    assert first is not None and 0 not in first.tolist()
    assert alloc.alloc(3) is None
    assert alloc.available_size() == 2
    rest = alloc.alloc(2)
    assert sorted(first.tolist() + rest.tolist()) == list(range(1, 9))
    assert alloc.alloc(1) is None
    assert alloc.alloc(0).numel() == 0


def test_double_free_raises() -> None:
    alloc = KVAllocator(16)
    got = alloc.alloc(4)
    alloc.free(got[:2])
    with pytest.raises(DoubleFreeError, match="freed twice"):
        alloc.free(got[1:3])
    with pytest.raises(DoubleFreeError):
        alloc.free(torch.tensor([got[3].item(), got[3].item()]))  # the same slot twice in one call
    with pytest.raises(DoubleFreeError):
        alloc.free(torch.tensor([0]))  # slot 0 is never allocated, so never freed
    with pytest.raises(DoubleFreeError):
        alloc.free(torch.tensor([17]))


def test_failed_free_leaves_accounting_intact() -> None:
    alloc = KVAllocator(10)
    got = alloc.alloc(5)
    alloc.free(got[:1])
    with pytest.raises(DoubleFreeError):
        alloc.free(got[:3])  # got[0] already free: the whole call is refused
    assert alloc.available_size() == 6
    alloc.free(got[1:])
    assert alloc.available_size() == 10


def test_clear_restores_every_slot() -> None:
    alloc = KVAllocator(5)
    alloc.alloc(5)
    alloc.clear()
    assert alloc.available_size() == 5
    assert sorted(alloc.alloc(5).tolist()) == [1, 2, 3, 4, 5]


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError):
        KVAllocator(0)
    with pytest.raises(ValueError):
        KVAllocator(4).alloc(-1)
