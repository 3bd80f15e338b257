"""MemoryReport: the start-up line names the KV pool in tokens and bytes, how many full-context requests it
holds and the weights' size; on a GPU what start-up left free. A runner logs it once it is built."""

from __future__ import annotations

import logging

import torch

from runtime.config import ServerArgs
from runtime.model_executor.memory_report import GIB, MemoryReport, size
from runtime.model_executor.model_runner import ModelRunner


def test_line_on_a_gpu_says_what_start_up_left_free() -> None:
    r = MemoryReport(pool_tokens=829_165, pool_bytes=int(101.217 * GIB), kv_dtype=torch.bfloat16,
                     weight_bytes=int(15.02 * GIB), context_len=131_072, free_bytes=int(19.5 * GIB),
                     total_bytes=int(139.8 * GIB))
    assert r.line() == ("KV pool: 829,165 tokens (101.22 GiB, bfloat16): 6.33 requests of the full 131,072-token "
                        "context at once; weights 15.02 GiB; 19.50 GiB of 139.80 GiB free after start-up "
                        "(activations take theirs from it; more pool: --mem-fraction-static)")


def test_runner_logs_its_pool_and_weights(tiny_llama, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="runtime.model_executor.model_runner"):
        runner = ModelRunner(ServerArgs(device="cpu", max_total_tokens=65536, dtype="float32"), str(tiny_llama))
    pool = runner.token_to_kv_pool
    pool_bytes = sum(t.numel() * t.element_size() for t in (*pool.k_buffers, *pool.v_buffers))
    weights = sum(t.numel() * t.element_size() for t in (*runner.model.parameters(), *runner.model.buffers()))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:")]
    assert len(lines) == 1
    assert pool_bytes < GIB and size(pool_bytes) == f"{pool_bytes / 2**20:.1f} MiB" != "0.0 MiB"
    assert lines[0].startswith(f"KV pool: 65,536 tokens ({size(pool_bytes)}, float32): "
                               f"{65536 / runner.context_len:.2f} requests of the full {runner.context_len:,}-token")
    assert f"weights {size(weights)}" in lines[0] and "free after start-up" not in lines[0]
