"""bench_decode_attention is GPU-only: on CPU it refuses clearly; its case filter and defaults hold."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_decode_attention


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_without_a_gpu() -> None:
    with pytest.raises(SystemExit, match="CUDA GPU"):
        bench_decode_attention.main(["--batch", "1", "--context", "128"])


def test_defaults_cover_small_batches_and_both_kv_dtypes() -> None:
    args = bench_decode_attention.parse_args([])
    assert args.batch[0] == 1 and 8192 in args.context
    assert set(args.kv_dtypes) == {"bfloat16", "float8_e4m3fn"} and all(hasattr(torch, n) for n in args.kv_dtypes)
    assert [tuple(int(x) for x in h.split("/")) for h in args.heads] == [(32, 8), (16, 4)]
