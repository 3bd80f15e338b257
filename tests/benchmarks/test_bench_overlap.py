"""bench_overlap is GPU-only (two CUDA streams in one graph): on CPU it refuses clearly; its defaults cover an
H100's bf16 wave (203) and an H200's (334, 414) at 1000 x 1000's mean context."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_overlap


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_without_a_gpu() -> None:
    with pytest.raises(SystemExit, match="CUDA GPU"):
        bench_overlap.main(["--batch", "2"])


def test_defaults() -> None:
    args = bench_overlap.parse_args([])
    assert args.batch == [203, 334, 414] and args.context == 1500
    assert (args.hidden, args.heads, args.kv_heads, args.intermediate) == (4096, 32, 8, 14336)  # Llama-3.1-8B
