"""The device-side kv_indices builder of FlashInferAttnBackend (runs in the Triton interpreter on CPU;
flashinfer itself is only imported when the backend is constructed), and the CUDA-graph batch sizes."""

from __future__ import annotations

import torch

from runtime.attention.flashinfer_backend import build_kv_indices
from runtime.model_executor.cuda_graph_runner import capture_batch_sizes


def test_build_kv_indices_flattens_req_to_token_rows() -> None:
    torch.manual_seed(0)
    req_to_token = torch.randint(1, 10_000, (6, 1200), dtype=torch.int32)
    rows = torch.tensor([4, 0, 5])
    seq_lens = torch.tensor([1, 1100, 513])  # spans several 512-wide blocks
    indptr = torch.tensor([0, 1, 1101, 1614], dtype=torch.int32)
    out = torch.full((1614 + 5,), -7, dtype=torch.int32)
    build_kv_indices(req_to_token, rows, seq_lens, indptr, out)
    expected = torch.cat([req_to_token[r, :n] for r, n in zip(rows.tolist(), seq_lens.tolist(), strict=True)])
    assert torch.equal(out[:1614], expected)
    assert (out[1614:] == -7).all()  # nothing written past the last request


def test_capture_batch_sizes() -> None:
    assert capture_batch_sizes(160) == [1, 2, 4, 8, *range(16, 161, 8)]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(1) == [1]
