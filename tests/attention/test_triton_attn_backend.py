"""TritonAttnBackend against TorchNativeAttnBackend on CPU (Triton interpreter, fp32, tiny shapes):
EXTEND over a cached prefix, MIXED (extends + decodes in one batch), DECODE and TARGET_VERIFY, outputs and stored K/V."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runtime.attention.spec import AttentionSpec
from runtime.attention.torch_native import TorchNativeAttnBackend
from runtime.attention.triton_backend import TritonAttnBackend
from runtime.layers.attention import Attention
from runtime.mem_cache.kv_pool import TokenToKVPool
from runtime.mem_cache.req_to_token import ReqToTokenPool
from runtime.messages import WorkerBatch
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.forward_mode import ForwardMode

HQ, HKV, D, SLOTS, CTX = 4, 2, 16, 96, 40


def _runner(seed: int) -> SimpleNamespace:
    """The ModelRunner attributes a backend reads, with the pool's prefix K/V filled at random."""
    torch.manual_seed(seed)
    layer = Attention(0, HQ, HKV, D, D**-0.5)
    kv = TokenToKVPool(SLOTS, 1, HKV, D, torch.float32, "cpu")
    kv.k_buffers[0].normal_()
    kv.v_buffers[0].normal_()
    pool = ReqToTokenPool(6, CTX, "cpu")
    spec = AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, scaling=D**-0.5, dtype=torch.float32,
                         device=torch.device("cpu"), req_to_token=pool.req_to_token, max_bs=6)
    return SimpleNamespace(device=torch.device("cpu"), req_to_token_pool=pool, token_to_kv_pool=kv, spec=spec, layer=layer)


def _batch(runner: SimpleNamespace, mode: ForwardMode, seq_lens: list[int], prefix_lens: list[int]) -> WorkerBatch:
    """Requests on rows 5, 4, ... with every token at a distinct random slot; prefix slots already mapped."""
    slots = (torch.randperm(SLOTS) + 1)[:sum(seq_lens)].tolist()
    rows = [5 - i for i in range(len(seq_lens))]
    out_cache_loc, off = [], 0
    for row, n, p in zip(rows, seq_lens, prefix_lens, strict=True):
        mine = slots[off:off + n]
        off += n
        runner.req_to_token_pool.write(row, 0, torch.tensor(mine[:p]))
        out_cache_loc += mine[p:]
    new = sum(seq_lens) - sum(prefix_lens)
    return WorkerBatch(batch_id=0, forward_mode=int(mode), input_ids=[0] * new, req_pool_indices=rows,
                       seq_lens=seq_lens, prefix_lens=prefix_lens, out_cache_loc=out_cache_loc)


def _run(runner: SimpleNamespace, backend, wb: WorkerBatch, qkv: tuple[torch.Tensor, ...]):
    fb = ForwardBatch.init_new(wb, runner.req_to_token_pool, runner.token_to_kv_pool, backend, runner.device)
    fb.write_req_to_token()
    backend.init_forward_metadata(fb)
    out = backend.forward(*qkv, runner.layer, fb)
    return out, runner.token_to_kv_pool.k_buffers[0].clone(), runner.token_to_kv_pool.v_buffers[0].clone()


CASES = {
    "extend": (ForwardMode.EXTEND, [12, 9, 1], [5, 0, 0]),
    "mixed": (ForwardMode.MIXED, [7, 20, 11, 3], [0, 13, 10, 2]),
    "decode": (ForwardMode.DECODE, [1, 17, 33, 5], [0, 16, 32, 4]),
    # The verify kernel: last token + drafts (ragged, as an eager step may be) over each cached prefix.
    "target_verify": (ForwardMode.TARGET_VERIFY, [9, 22, 35, 3], [4, 17, 32, 2]),
}


@pytest.mark.parametrize("case", CASES)
def test_triton_backend_matches_torch_native(case: str) -> None:
    mode, seq_lens, prefix_lens = CASES[case]
    results = []
    for cls in (TorchNativeAttnBackend, TritonAttnBackend):
        runner = _runner(seed=1)  # identical pools and slot layout for both backends
        wb = _batch(runner, mode, seq_lens, prefix_lens)
        new = len(wb.input_ids)
        qkv = (torch.randn(new, HQ * D), torch.randn(new, HKV * D), torch.randn(new, HKV * D))
        results.append(_run(runner, cls(runner.spec), wb, qkv))
    (ref, k_ref, v_ref), (out, k_buf, v_buf) = results
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_triton_backend_graph_hooks_reject_extend() -> None:
    runner = _runner(seed=2)
    backend = TritonAttnBackend(runner.spec)
    backend.init_cuda_graph_state(4)
    with pytest.raises(NotImplementedError):
        backend.init_forward_metadata_capture_cuda_graph(2, torch.zeros(2, dtype=torch.int64),
                                                         torch.ones(2, dtype=torch.int64), ForwardMode.EXTEND)
    assert backend.supports_cuda_graph and backend.get_cuda_graph_seq_len_fill_value() == 1


def test_triton_verify_after_capture_reuses_the_graphs_row_count() -> None:
    """After a TARGET_VERIFY capture for K + 1 = 5 tokens, a ragged eager verify (at most 3 new tokens) runs
    the kernel compiled for 5 rows (no new JIT compile) and still matches torch_native."""
    mode, seq_lens, prefix_lens = ForwardMode.TARGET_VERIFY, [9, 22, 5], [6, 20, 4]
    results = []
    for cls in (TorchNativeAttnBackend, TritonAttnBackend):
        runner = _runner(seed=3)
        wb = _batch(runner, mode, seq_lens, prefix_lens)
        backend = cls(runner.spec)
        if cls is TritonAttnBackend:
            backend.init_cuda_graph_state(4)
            backend.init_forward_metadata_capture_cuda_graph(4, torch.zeros(4, dtype=torch.int64),
                                                             torch.full((4,), 5, dtype=torch.int64), mode,
                                                             tokens_per_req=5)
        new = len(wb.input_ids)
        qkv = (torch.randn(new, HQ * D), torch.randn(new, HKV * D), torch.randn(new, HKV * D))
        results.append(_run(runner, backend, wb, qkv))
        if cls is TritonAttnBackend:
            assert backend._verify_rows == 5
    torch.testing.assert_close(results[1][0], results[0][0], atol=2e-5, rtol=2e-5)
