"""Shared pieces of the GPU attention-backend tests (bf16 and FP8 KV): Llama-8B head shapes, a one-layer
runner with its pools, batches with cached prefixes laid out at random slots, and the backends to test."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from runtime.attention.spec import AttentionSpec
from runtime.layers.attention import Attention
from runtime.mem_cache.kv_pool import TokenToKVPool
from runtime.mem_cache.req_to_token import ReqToTokenPool
from runtime.messages import WorkerBatch
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.forward_mode import ForwardMode

HQ, HKV, D, SLOTS, CTX, ROWS = 32, 8, 128, 40_000, 4096, 16
DT = torch.bfloat16
BACKENDS = ["triton", pytest.param("flashinfer", marks=pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed"))]
CASES = {
    "extend": (ForwardMode.EXTEND, [1000, 300, 1, 2048], [600, 0, 0, 1]),
    "mixed": (ForwardMode.MIXED, [700, 129, 1500, 40, 3000], [0, 64, 1499, 39, 2999]),
    "decode": (ForwardMode.DECODE, [1, 2, 33, 1000, 4000, 517], [0, 1, 32, 999, 3999, 516]),
}


def make_runner(seed: int, kv_dtype: torch.dtype = DT, kv_scale: float = 1.0) -> SimpleNamespace:
    """One attention layer over a random KV pool (FP8 pools hold randn values cast to fp8)."""
    torch.manual_seed(seed)
    layer = Attention(0, HQ, HKV, D, D**-0.5)
    fp8 = kv_dtype != DT
    kv = TokenToKVPool(SLOTS, 1, HKV, D, kv_dtype, "cuda", **({"kv_scale": kv_scale} if fp8 else {}))
    for buf in (kv.k_buffers[0], kv.v_buffers[0]):
        buf.copy_(torch.randn(SLOTS + 1, HKV, D, device="cuda").to(kv_dtype))
    pool = ReqToTokenPool(ROWS, CTX, "cuda")
    spec = AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, scaling=D**-0.5, dtype=DT,
                         device=torch.device("cuda"), req_to_token=pool.req_to_token, max_bs=ROWS,
                         **({"kv_dtype": kv_dtype} if fp8 else {}))
    return SimpleNamespace(device=torch.device("cuda"), req_to_token_pool=pool, token_to_kv_pool=kv, spec=spec,
                           layer=layer)


def make_batch(runner: SimpleNamespace, mode: ForwardMode, seq_lens: list[int], prefix_lens: list[int]) -> WorkerBatch:
    """Requests at the last table rows; each prefix's slots written to the table, new tokens' slots in
    out_cache_loc (all distinct, random)."""
    slots = (torch.randperm(SLOTS) + 1)[:sum(seq_lens)].tolist()
    rows = [ROWS - 1 - i for i in range(len(seq_lens))]
    out_cache_loc, off = [], 0
    for row, n, p in zip(rows, seq_lens, prefix_lens, strict=True):
        mine = slots[off:off + n]
        off += n
        runner.req_to_token_pool.write(row, 0, torch.tensor(mine[:p], device="cuda"))
        out_cache_loc += mine[p:]
    new = sum(seq_lens) - sum(prefix_lens)
    return WorkerBatch(batch_id=0, forward_mode=int(mode), input_ids=[0] * new, req_pool_indices=rows,
                       seq_lens=seq_lens, prefix_lens=prefix_lens, out_cache_loc=out_cache_loc)


def make_fb(runner: SimpleNamespace, backend: object, wb: WorkerBatch) -> ForwardBatch:
    fb = ForwardBatch.init_new(wb, runner.req_to_token_pool, runner.token_to_kv_pool, backend, runner.device)
    fb.write_req_to_token()
    return fb


def make_backend(name: str, runner: SimpleNamespace) -> object:
    from runtime.attention.registry import create_attention_backend

    return create_attention_backend(name, runner.spec)
