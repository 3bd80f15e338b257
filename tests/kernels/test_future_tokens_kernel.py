"""The overlap scheduler's placeholder ids (-(r + 1) = request row r's token just sampled) resolved by the
one-launch kernel exactly as the torch form, including ids 0, the last row, and ragged lengths."""

import pytest
import torch

from kernels.future_tokens import resolve_future_ids, resolve_future_ids_kernel, resolve_future_ids_ref


@pytest.mark.parametrize("n", [0, 1, 7, 1500])
def test_kernel_equals_torch(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    future = torch.randint(0, 128256, (40,), generator=gen)
    ids = torch.randint(0, 128256, (n,), generator=gen)
    placeholders = torch.rand(n, generator=gen) < 0.5
    ids[placeholders] = -(torch.randint(0, 40, (int(placeholders.sum()),), generator=gen) + 1)
    if n:
        ids[0] = 0 if n > 1 else -40  # a real token id 0, or the last row's placeholder
    before = ids.clone()
    want = resolve_future_ids_ref(ids.clone(), future)
    assert torch.equal(resolve_future_ids_kernel(ids, future), want)
    assert torch.equal(resolve_future_ids(ids, future), want)  # CPU: the torch form
    assert torch.equal(ids, before) and bool((want >= 0).all())
