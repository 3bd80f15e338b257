"""A replay's inputs staged into the graph's static buffers in one launch, against the copies and padded-
row resets CudaGraphRunner ran before: same buffers after, for exact, padded and multi-token steps, over
stale contents left by an earlier larger batch."""

import pytest
import torch

from kernels.graph_inputs import stage_graph_inputs, stage_graph_inputs_ref


@pytest.mark.parametrize(("bs", "padded", "k"), [(1, 1, 1), (3, 4, 1), (13, 16, 1), (5, 8, 5), (300, 304, 1)])
def test_stage_equals_copies(bs: int, padded: int, k: int) -> None:
    gen = torch.Generator().manual_seed(bs)
    max_bs, max_k = 320, 5

    def buffers() -> tuple[torch.Tensor, ...]:
        torch.manual_seed(1)  # the same stale contents in both sets
        return tuple(torch.randint(0, 10_000, (n,)) for n in (max_bs * max_k,) * 3 + (max_bs,) * 3)

    src = tuple(torch.randint(0, 10_000, (n,), generator=gen) for n in (bs * k,) * 3 + (bs,) * 3)
    a, b = buffers(), buffers()
    stage_graph_inputs(a, src, bs, padded, k, seq_fill=max(1, k))
    stage_graph_inputs_ref(b, src, bs, padded, k, seq_fill=max(1, k))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_stage_rejects_other_dtypes() -> None:
    bufs = tuple(torch.zeros(8, dtype=torch.int64) for _ in range(6))
    with pytest.raises(ValueError, match="int64"):
        stage_graph_inputs(bufs, (torch.zeros(1, dtype=torch.int32),) + bufs[1:], 1, 1, 1, 1)


@pytest.mark.parametrize(("bs", "padded", "k"), [(1, 1, 1), (3, 4, 1), (13, 16, 1), (5, 8, 5)])
def test_stage_resolves_writes_table_and_fills_rows(bs: int, padded: int, k: int) -> None:
    """The decode replay's staging also resolves placeholder ids, records the KV slots in the request→token
    table (real tokens only: padded rows must not touch a request's row) and fills the greedy tail's rows."""
    gen = torch.Generator().manual_seed(bs)
    max_bs, reqs, ctx = 16, 20, 64
    future = torch.randint(0, 50_000, (reqs + 1,), generator=gen)
    rpi = torch.randperm(reqs, generator=gen)[:bs]
    pos = torch.stack([torch.randperm(ctx, generator=gen)[:k] for _ in range(bs)]).reshape(-1)
    ids = torch.randint(0, 50_000, (bs * k,), generator=gen)
    ids[::2] = -(rpi.repeat_interleave(k)[::2] + 1)  # placeholders for half the tokens
    src = (ids, pos, torch.randint(1, 10_000, (bs * k,), generator=gen), rpi,
           torch.randint(1, 100, (bs,), generator=gen), torch.randint(0, 100, (bs,), generator=gen))

    def state() -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        torch.manual_seed(2)  # the same stale contents in both sets
        dst = tuple(torch.randint(0, 10_000, (n,)) for n in (max_bs * k,) * 3 + (max_bs,) * 3)
        return dst, torch.randint(0, 10_000, (reqs, ctx), dtype=torch.int32), torch.randint(0, 9, (max_bs,))

    (a, ta, ra), (b, tb, rb) = state(), state()
    kw = {"future": future, "scratch_row": reqs}
    stage_graph_inputs(a, src, bs, padded, k, max(1, k), req_to_token=ta, rows=ra, **kw)
    stage_graph_inputs_ref(b, src, bs, padded, k, max(1, k), req_to_token=tb, rows=rb, **kw)
    for x, y in zip((*a, ta, ra), (*b, tb, rb), strict=True):
        assert torch.equal(x, y)
    want_ids = torch.where(ids < 0, future[(-ids - 1).clamp(min=0)], ids)
    assert torch.equal(a[0][:bs * k], want_ids) and bool((a[0][:bs * k] >= 0).all())
    assert torch.equal(ta[rpi.repeat_interleave(k), pos], src[2].to(torch.int32))
    assert torch.equal(ra[:bs], rpi) and bool((ra[bs:padded] == reqs).all())
    untouched = torch.ones(reqs, ctx, dtype=torch.bool)
    untouched[rpi.repeat_interleave(k), pos] = False
    assert torch.equal(ta[untouched], tb[untouched]) and torch.equal(ta[untouched], state()[1][untouched])


def test_stage_rejects_a_table_of_another_dtype() -> None:
    bufs = tuple(torch.zeros(8, dtype=torch.int64) for _ in range(6))
    with pytest.raises(ValueError, match="int32"):
        stage_graph_inputs(bufs, bufs, 1, 1, 1, 1, req_to_token=torch.zeros(2, 8, dtype=torch.int64))
