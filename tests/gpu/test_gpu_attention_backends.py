"""Triton and FlashInfer attention backends against torch_native on the GPU (bf16, Llama-8B head shapes):
EXTEND over cached prefixes, MIXED, DECODE; and DECODE captured in a CUDA graph through the backend hooks,
replayed with new lengths and padded rows."""

from __future__ import annotations

import pytest
import torch
from attention_cases import BACKENDS, CASES, DT, HKV, HQ, D, make_backend, make_batch, make_fb, make_runner

from runtime.attention.torch_native import TorchNativeAttnBackend
from runtime.messages import WorkerBatch
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.forward_mode import ForwardMode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

TOL = {"atol": 2e-2, "rtol": 2e-2}












@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_backend_matches_torch_native_gpu(name: str, case: str) -> None:
    mode, seq_lens, prefix_lens = CASES[case]
    results = []
    for make in (lambda r: TorchNativeAttnBackend(r.spec), lambda r: make_backend(name, r)):
        runner = make_runner(seed=3)
        wb = make_batch(runner, mode, seq_lens, prefix_lens)
        new = len(wb.input_ids)
        qkv = (torch.randn(new, HQ * D, device="cuda", dtype=DT), torch.randn(new, HKV * D, device="cuda", dtype=DT),
               torch.randn(new, HKV * D, device="cuda", dtype=DT))
        backend = make(runner)
        fb = make_fb(runner, backend, wb)
        backend.init_forward_metadata(fb)
        out = backend.forward(*qkv, runner.layer, fb)
        results.append((out, runner.token_to_kv_pool.k_buffers[0], runner.token_to_kv_pool.v_buffers[0]))
    (ref, k_ref, v_ref), (out, k_buf, v_buf) = results
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_backend_decode_cuda_graph_replay(name: str, kv: str) -> None:
    """Capture at bs 4 with placeholder lengths; replay a 3-request batch padded to 4 (padded row:
    slot 0, seq_len fill value, row 0) twice with different lengths; compare with eager torch_native
    (bf16 KV, and an FP8 pool with a scale of 0.5)."""
    runner = make_runner(seed=4) if kv == "bf16" else make_runner(seed=4, kv_dtype=torch.float8_e4m3fn, kv_scale=0.5)
    backend = make_backend(name, runner)
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
        wb = make_batch(runner, ForwardMode.DECODE, lens, [n - 1 for n in lens])
        real = make_fb(runner, backend, wb)
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
        graph.replay()
        torch.cuda.synchronize()
        ref_backend = TorchNativeAttnBackend(runner.spec)
        real.attn_backend = ref_backend
        ref = ref_backend.forward(new_q, new_k, new_v, runner.layer, real)
        torch.testing.assert_close(out[:3], ref, **(TOL if kv == "bf16" else {"atol": 3e-2, "rtol": 3e-2}))
        # The padded row wrote its (zero) K into scratch slot 0 only.
        assert runner.token_to_kv_pool.k_buffers[0][0].view(torch.uint8).eq(0).all()


@pytest.mark.parametrize("name", BACKENDS)
def test_graph_replay_planning_does_not_wait_for_the_gpu(name: str) -> None:
    """Overlap scheduling plans step N+1 while step N still runs: the replay hook must queue its copies
    and return, never wait for the device (flashinfer's plan() once copied a device last_page_len to the
    host, which waited for the step in flight on every replayed decode)."""
    runner = make_runner(seed=5)
    backend = make_backend(name, runner)
    bs = 4
    backend.init_cuda_graph_state(8)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    static = ForwardBatch.init_new(
        WorkerBatch(batch_id=0, forward_mode=int(ForwardMode.DECODE), input_ids=[0] * bs, req_pool_indices=[0] * bs,
                    seq_lens=[fill] * bs, prefix_lens=[fill - 1] * bs, out_cache_loc=[0] * bs),
        runner.req_to_token_pool, runner.token_to_kv_pool, backend, runner.device)
    backend.init_forward_metadata_capture_cuda_graph(bs, static.req_pool_indices, static.seq_lens, ForwardMode.DECODE)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # the "step in flight": about a second of device time
    backend.init_forward_metadata_replay_cuda_graph(bs, static.req_pool_indices, static.seq_lens, fill * bs,
                                                    ForwardMode.DECODE, seq_lens_cpu=[fill] * bs)
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy, f"{name}: planning a replayed decode waited for the GPU"
