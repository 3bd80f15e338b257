"""Triton and FlashInfer attention backends against torch_native on the GPU (bf16, Llama-8B head shapes):
EXTEND over cached prefixes, MIXED, DECODE; and DECODE captured in a CUDA graph through the backend hooks,
replayed with new lengths and padded rows."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from runtime.attention.spec import AttentionSpec
from runtime.attention.torch_native import TorchNativeAttnBackend
from runtime.layers.attention import Attention
from runtime.mem_cache.kv_pool import TokenToKVPool
from runtime.mem_cache.req_to_token import ReqToTokenPool
from runtime.messages import WorkerBatch
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.forward_mode import ForwardMode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

HQ, HKV, D, SLOTS, CTX, ROWS = 32, 8, 128, 40_000, 4096, 16
DT = torch.bfloat16
TOL = {"atol": 2e-2, "rtol": 2e-2}
BACKENDS = ["triton", pytest.param("flashinfer", marks=pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed"))]


def _backend(name: str, runner: SimpleNamespace):
    from runtime.attention.registry import create_attention_backend

    return create_attention_backend(name, runner.spec)


def _runner(seed: int) -> SimpleNamespace:
    torch.manual_seed(seed)
    layer = Attention(0, HQ, HKV, D, D**-0.5)
    kv = TokenToKVPool(SLOTS, 1, HKV, D, DT, "cuda")
    kv.k_buffers[0].normal_()
    kv.v_buffers[0].normal_()
    pool = ReqToTokenPool(ROWS, CTX, "cuda")
    spec = AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, scaling=D**-0.5, dtype=DT,
                         device=torch.device("cuda"), req_to_token=pool.req_to_token, max_bs=ROWS)
    return SimpleNamespace(device=torch.device("cuda"), req_to_token_pool=pool, token_to_kv_pool=kv, spec=spec, layer=layer)


def _batch(runner, mode: ForwardMode, seq_lens: list[int], prefix_lens: list[int]) -> WorkerBatch:
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


def _fb(runner, backend, wb: WorkerBatch) -> ForwardBatch:
    fb = ForwardBatch.init_new(wb, runner.req_to_token_pool, runner.token_to_kv_pool, backend, runner.device)
    fb.write_req_to_token()
    return fb


CASES = {
    "extend": (ForwardMode.EXTEND, [1000, 300, 1, 2048], [600, 0, 0, 1]),
    "mixed": (ForwardMode.MIXED, [700, 129, 1500, 40, 3000], [0, 64, 1499, 39, 2999]),
    "decode": (ForwardMode.DECODE, [1, 2, 33, 1000, 4000, 517], [0, 1, 32, 999, 3999, 516]),
}


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_backend_matches_torch_native_gpu(name: str, case: str) -> None:
    mode, seq_lens, prefix_lens = CASES[case]
    results = []
    for make in (lambda r: TorchNativeAttnBackend(r.spec), lambda r: _backend(name, r)):
        runner = _runner(seed=3)
        wb = _batch(runner, mode, seq_lens, prefix_lens)
        new = len(wb.input_ids)
        qkv = (torch.randn(new, HQ * D, device="cuda", dtype=DT), torch.randn(new, HKV * D, device="cuda", dtype=DT),
               torch.randn(new, HKV * D, device="cuda", dtype=DT))
        backend = make(runner)
        fb = _fb(runner, backend, wb)
        backend.init_forward_metadata(fb)
        out = backend.forward(*qkv, runner.layer, fb)
        results.append((out, runner.token_to_kv_pool.k_buffers[0], runner.token_to_kv_pool.v_buffers[0]))
    (ref, k_ref, v_ref), (out, k_buf, v_buf) = results
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_decode_cuda_graph_replay(name: str) -> None:
    """Capture at bs 4 with placeholder lengths; replay a 3-request batch padded to 4 (padded row:
    slot 0, seq_len fill value, row 0) twice with different lengths; compare with eager torch_native."""
    runner = _runner(seed=4)
    backend = _backend(name, runner)
    max_bs, bs = 8, 4
    backend.init_cuda_graph_state(max_bs)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    q = torch.zeros(bs, HQ * D, device="cuda", dtype=DT)
    k, v = torch.zeros(bs, HKV * D, device="cuda", dtype=DT), torch.zeros(bs, HKV * D, device="cuda", dtype=DT)
    static = ForwardBatch.init_new(
        WorkerBatch(batch_id=0, forward_mode=int(ForwardMode.DECODE), input_ids=[0] * bs, req_pool_indices=[0] * bs,
                    seq_lens=[fill] * bs, prefix_lens=[fill - 1] * bs, out_cache_loc=[0] * bs),
        runner.req_to_token_pool, runner.token_to_kv_pool, backend, runner.device)
    backend.init_forward_metadata_capture_cuda_graph(bs, static.req_pool_indices, static.seq_lens, ForwardMode.DECODE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, runner.layer, static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, runner.layer, static)

    for lens in ([5, 3000, 77], [1, 129, 4000]):
        wb = _batch(runner, ForwardMode.DECODE, lens, [n - 1 for n in lens])
        real = _fb(runner, backend, wb)
        new_q = torch.randn(3, HQ * D, device="cuda", dtype=DT)
        new_k, new_v = torch.randn(3, HKV * D, device="cuda", dtype=DT), torch.randn(3, HKV * D, device="cuda", dtype=DT)
        for dst, src in ((q, new_q), (k, new_k), (v, new_v)):
            dst[:3].copy_(src)
        static.out_cache_loc[:3].copy_(real.out_cache_loc)
        static.req_pool_indices[:3].copy_(real.req_pool_indices)
        static.seq_lens[:3].copy_(real.seq_lens)
        backend.init_forward_metadata_replay_cuda_graph(bs, static.req_pool_indices, static.seq_lens,
                                                        sum(lens) + fill, ForwardMode.DECODE,
                                                        seq_lens_cpu=[*lens, fill])
        slot0 = runner.token_to_kv_pool.k_buffers[0][0].clone()
        graph.replay()
        torch.cuda.synchronize()
        ref_backend = TorchNativeAttnBackend(runner.spec)
        real.attn_backend = ref_backend
        ref = ref_backend.forward(new_q, new_k, new_v, runner.layer, real)
        torch.testing.assert_close(out[:3], ref, **TOL)
        # The padded row wrote its (zero) K into scratch slot 0 only.
        assert torch.equal(runner.token_to_kv_pool.k_buffers[0][0], torch.zeros_like(slot0))
