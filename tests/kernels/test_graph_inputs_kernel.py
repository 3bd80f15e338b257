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
