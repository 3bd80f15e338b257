"""Packed oneDNN linears pad their rows to a few buckets: oneDNN keeps one ~0.6 MB primitive per input
shape, so a server whose batch row counts took every value kept growing its RSS (the CPU soak)."""

import pytest
import torch
import torch.nn.functional as F

from runtime.model_executor import cpu_linear


def test_buckets_are_few_and_pad_by_less_than_an_eighth():
    buckets = {cpu_linear.bucket_rows(m) for m in range(1, 16385)}
    assert len(buckets) <= 110  # the shape cache holds ~5 linears x this many primitives at most
    for m in range(1, 16385):
        b = cpu_linear.bucket_rows(m)
        assert b >= m and (b - m) * 8 < m
        assert cpu_linear.bucket_rows(b) == b  # a bucket is its own bucket
    assert all(cpu_linear.bucket_rows(m) == m for m in range(1, cpu_linear.EXACT_ROWS + 1))


@pytest.mark.skipif(not cpu_linear.packed_linear_available(), reason="oneDNN bf16 unavailable")
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 11, 576), (33, 576), (2, 150, 576), (1000, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_padded_rows_give_f_linear_outputs(shape, with_bias):
    torch.manual_seed(0)
    w = torch.randn(200, 576, dtype=torch.bfloat16)
    b = torch.randn(200, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(*shape, dtype=torch.bfloat16)
    y = cpu_linear._linear(x, cpu_linear._pack(w), b)
    assert y.shape == (*shape[:-1], 200) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=0)
