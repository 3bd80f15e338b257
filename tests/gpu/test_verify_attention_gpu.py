"""The verify attention kernel on CUDA in bf16 at the 8B shape (32 q heads, 8 KV heads, head dim 128):
against the fp32 reference, ragged and windowed, and replayed from a CUDA graph with new lengths."""

import pytest
import torch

from kernels.extend_attention import extend_attention_ref
from kernels.verify_attention import verify_attention_fwd, verify_attention_workspace

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

ATTN_TOL = {"atol": 2e-2, "rtol": 2e-2}  # bf16 inputs and P@V, fp32 accumulation


def _paged(seq_lens: list[int], prefix_lens: list[int], hq: int = 32, hkv: int = 8, d: int = 128) -> dict:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    total, slots_n = sum(seq_lens), sum(seq_lens) + 1001
    k_buf, v_buf = torch.randn(slots_n, hkv, d, device=dev, dtype=dt), torch.randn(slots_n, hkv, d, device=dev, dtype=dt)
    rows = torch.randperm(len(seq_lens) + 5, device=dev)[:len(seq_lens)]
    r2t = torch.zeros(len(seq_lens) + 5, max(seq_lens) + 8, dtype=torch.int32, device=dev)
    slots = torch.randperm(slots_n - 1, device=dev)[:total] + 1
    ext = [s - p for s, p in zip(seq_lens, prefix_lens, strict=True)]
    q = torch.randn(sum(ext), hq, d, device=dev, dtype=dt)
    off, starts = 0, []
    for b, n in enumerate(seq_lens):
        r2t[rows[b], :n] = slots[off:off + n].int()
        off += n
        starts.append(sum(ext[:b]))
    new = torch.cat([r2t[rows[b], p:s].long() for b, (s, p) in enumerate(zip(seq_lens, prefix_lens))])
    return {"q": q, "k": k_buf[new], "v": v_buf[new], "k_buffer": k_buf, "v_buffer": v_buf, "req_to_token": r2t,
            "req_pool_indices": rows, "seq_lens": torch.tensor(seq_lens, device=dev),
            "prefix_lens": torch.tensor(prefix_lens, device=dev), "extend_start_loc": torch.tensor(starts, device=dev),
            "max_extend_len": max(ext), "sm_scale": d ** -0.5}


def _ref(pb: dict, window: int = 0) -> torch.Tensor:
    return extend_attention_ref(pb["q"], pb["k"], pb["v"], pb["k_buffer"], pb["v_buffer"], pb["req_to_token"],
                                pb["req_pool_indices"], pb["seq_lens"], pb["prefix_lens"], pb["extend_start_loc"],
                                pb["sm_scale"], sliding_window=window)


def _run(pb: dict, o: torch.Tensor, window: int = 0, workspace: torch.Tensor | None = None) -> None:
    verify_attention_fwd(pb["q"], pb["k_buffer"], pb["v_buffer"], o, pb["req_to_token"], pb["req_pool_indices"],
                         pb["seq_lens"], pb["prefix_lens"], pb["extend_start_loc"], pb["max_extend_len"],
                         pb["sm_scale"], num_kv_splits=8, workspace=workspace, sliding_window=window)


@pytest.mark.parametrize("window", [0, 100])
def test_verify_attention_gpu(window: int) -> None:
    seq_lens = [5, 6, 600, 4000, 130, 2049, 3, 777]
    prefix_lens = [0, 1, 595, 3996, 128, 2044, 2, 772]  # up to K + 1 = 5 new tokens, ragged
    pb = _paged(seq_lens, prefix_lens)
    o = torch.full_like(pb["q"], float("nan"))
    _run(pb, o, window)
    torch.testing.assert_close(o, _ref(pb, window), **ATTN_TOL)


def test_verify_attention_cuda_graph_replay() -> None:
    bs, n = 16, 5
    pb = _paged([700] * bs, [695] * bs)
    o = torch.empty_like(pb["q"])
    ws = verify_attention_workspace(bs * n, 32, 128, 8, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(pb, o, workspace=ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(pb, o, workspace=ws)
    for lens in ([5, 9, 64, 700] * 4, [699, 300, 37, 100] * 4):
        pb["seq_lens"].copy_(torch.tensor(lens, device="cuda"))
        pb["prefix_lens"].copy_(pb["seq_lens"] - n)
        graph.replay()
        torch.cuda.synchronize()
        new = torch.cat([pb["req_to_token"][pb["req_pool_indices"][b], s - n:s].long() for b, s in enumerate(lens)])
        pb["k"], pb["v"] = pb["k_buffer"][new], pb["v_buffer"][new]
        torch.testing.assert_close(o, _ref(pb), **ATTN_TOL)
