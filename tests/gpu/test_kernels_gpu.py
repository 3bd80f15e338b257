"""The kernels/ checks again on CUDA, in bf16 and at realistic sizes, plus CUDA-graph replay of decode."""

import itertools

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.decode_attention import decode_attention_fwd, decode_attention_ref, decode_attention_workspace
from kernels.extend_attention import extend_attention_fwd, extend_attention_ref
from kernels.kv_store import store_kv, store_kv_ref
from kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from kernels.rotary import apply_rotary, apply_rotary_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

DTYPE = torch.bfloat16
# bf16 inputs, bf16 probabilities in P@V, fp32 accumulation: a few bf16 ulps against an fp32 reference.
ATTN_TOL = {"atol": 2e-2, "rtol": 2e-2}


def _paged(seq_lens: list[int], prefix_lens: list[int], hq: int, hkv: int, d: int, seed: int = 0) -> dict:
    """Paged KV at random slots; request b's new tokens (q/k/v rows) are also written to the buffers."""
    torch.manual_seed(seed)
    dev = "cuda"
    batch, total = len(seq_lens), sum(seq_lens)
    num_slots = total + 1 + 1000
    k_buffer = torch.randn(num_slots, hkv, d, device=dev, dtype=DTYPE)
    v_buffer = torch.randn(num_slots, hkv, d, device=dev, dtype=DTYPE)
    max_reqs = batch + 7
    req_to_token = torch.zeros(max_reqs, max(seq_lens) + 16, dtype=torch.int32, device=dev)
    req_pool_indices = torch.randperm(max_reqs, device=dev)[:batch]
    slots = torch.randperm(num_slots - 1, device=dev)[:total] + 1
    ext = [s - p for s, p in zip(seq_lens, prefix_lens, strict=True)]
    t_new = sum(ext)
    q = torch.randn(t_new, hq, d, device=dev, dtype=DTYPE)
    k = torch.randn(t_new, hkv, d, device=dev, dtype=DTYPE)
    v = torch.randn(t_new, hkv, d, device=dev, dtype=DTYPE)
    off = new_off = 0
    starts = []
    for b, (n, p) in enumerate(zip(seq_lens, prefix_lens, strict=True)):
        req_slots = slots[off:off + n]
        off += n
        req_to_token[req_pool_indices[b], :n] = req_slots.int()
        k_buffer[req_slots[p:]] = k[new_off:new_off + n - p]
        v_buffer[req_slots[p:]] = v[new_off:new_off + n - p]
        starts.append(new_off)
        new_off += n - p
    return {
        "q": q, "k": k, "v": v, "k_buffer": k_buffer, "v_buffer": v_buffer, "req_to_token": req_to_token,
        "req_pool_indices": req_pool_indices,
        "seq_lens": torch.tensor(seq_lens, device=dev),
        "prefix_lens": torch.tensor(prefix_lens, device=dev),
        "extend_start_loc": torch.tensor(starts, device=dev),
        "max_extend_len": max(ext), "sm_scale": d ** -0.5,
    }


def _decode_ref(pb: dict, seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    return decode_attention_ref(pb["q"], pb["k_buffer"], pb["v_buffer"], pb["req_to_token"],
                                pb["req_pool_indices"], pb["seq_lens"] if seq_lens is None else seq_lens,
                                pb["sm_scale"])


@pytest.mark.parametrize(("hq", "hkv", "d"), [(32, 8, 128), (32, 32, 128), (9, 3, 64)])
def test_decode_attention_gpu(hq: int, hkv: int, d: int) -> None:
    gen = torch.Generator().manual_seed(0)
    seq_lens = [1, 2, 31, 33, 4096, 4000] + torch.randint(1, 4097, (58,), generator=gen).tolist()
    pb = _paged(seq_lens, [n - 1 for n in seq_lens], hq, hkv, d)
    o = torch.full_like(pb["q"], float("nan"))
    decode_attention_fwd(pb["q"], pb["k_buffer"], pb["v_buffer"], o, pb["req_to_token"],
                         pb["req_pool_indices"], pb["seq_lens"], pb["sm_scale"], num_kv_splits=8)
    torch.testing.assert_close(o, _decode_ref(pb), **ATTN_TOL)


def test_decode_attention_cuda_graph_replay() -> None:
    max_bs, hq, hkv, d, splits = 16, 32, 8, 128, 8
    pb = _paged([300] * max_bs, [299] * max_bs, hq, hkv, d)
    q, o = pb["q"].clone(), torch.empty_like(pb["q"])
    seq_lens = pb["seq_lens"].clone()
    req_pool_indices = pb["req_pool_indices"].clone()
    workspace = decode_attention_workspace(max_bs, hq, d, splits, "cuda")

    def step() -> None:
        decode_attention_fwd(q, pb["k_buffer"], pb["v_buffer"], o, pb["req_to_token"], req_pool_indices,
                             seq_lens, pb["sm_scale"], num_kv_splits=splits, attn_logits=workspace)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    # New lengths (shorter and longer than at capture) and new queries, replayed without re-capture.
    for lens in ([1, 5, 64, 300] * 4, [299, 2, 250, 100] * 4):
        seq_lens.copy_(torch.tensor(lens, device="cuda"))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        expected = decode_attention_ref(q, pb["k_buffer"], pb["v_buffer"], pb["req_to_token"],
                                        req_pool_indices, seq_lens, pb["sm_scale"])
        torch.testing.assert_close(o, expected, **ATTN_TOL)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(32, 8, 128), (32, 32, 128), (9, 3, 64)])
def test_extend_attention_gpu(hq: int, hkv: int, d: int) -> None:
    seq_lens = [1, 100, 1024, 2048, 777, 3000, 64, 129]
    prefix_lens = [0, 99, 0, 1500, 700, 2000, 0, 64]
    pb = _paged(seq_lens, prefix_lens, hq, hkv, d)
    o = torch.full_like(pb["q"], float("nan"))
    extend_attention_fwd(pb["q"], pb["k"], pb["v"], o, pb["k_buffer"], pb["v_buffer"], pb["req_to_token"],
                         pb["req_pool_indices"], pb["seq_lens"], pb["prefix_lens"], pb["extend_start_loc"],
                         pb["max_extend_len"], pb["sm_scale"])
    expected = extend_attention_ref(pb["q"], pb["k"], pb["v"], pb["k_buffer"], pb["v_buffer"],
                                    pb["req_to_token"], pb["req_pool_indices"], pb["seq_lens"],
                                    pb["prefix_lens"], pb["extend_start_loc"], pb["sm_scale"])
    torch.testing.assert_close(o, expected, **ATTN_TOL)


@pytest.mark.parametrize("window", [1, 100, 4096])
def test_sliding_window_attention_gpu(window: int) -> None:
    """The windowed decode and extend kernels compiled for the GPU (the CPU tests run the interpreter)."""
    hq, hkv, d = 32, 8, 128
    seq_lens = [1, 100, 1024, 2048, 777, 3000, 64, 5000]
    pb = _paged(seq_lens, [n - 1 for n in seq_lens], hq, hkv, d)
    o = torch.full_like(pb["q"], float("nan"))
    decode_attention_fwd(pb["q"], pb["k_buffer"], pb["v_buffer"], o, pb["req_to_token"], pb["req_pool_indices"],
                         pb["seq_lens"], pb["sm_scale"], num_kv_splits=8, sliding_window=window)
    expected = decode_attention_ref(pb["q"], pb["k_buffer"], pb["v_buffer"], pb["req_to_token"],
                                    pb["req_pool_indices"], pb["seq_lens"], pb["sm_scale"], sliding_window=window)
    torch.testing.assert_close(o, expected, **ATTN_TOL)
    prefix_lens = [0, 99, 0, 1500, 700, 2000, 0, 4000]
    pb = _paged(seq_lens, prefix_lens, hq, hkv, d)
    o = torch.full_like(pb["q"], float("nan"))
    extend_attention_fwd(pb["q"], pb["k"], pb["v"], o, pb["k_buffer"], pb["v_buffer"], pb["req_to_token"],
                         pb["req_pool_indices"], pb["seq_lens"], pb["prefix_lens"], pb["extend_start_loc"],
                         pb["max_extend_len"], pb["sm_scale"], sliding_window=window)
    expected = extend_attention_ref(pb["q"], pb["k"], pb["v"], pb["k_buffer"], pb["v_buffer"], pb["req_to_token"],
                                    pb["req_pool_indices"], pb["seq_lens"], pb["prefix_lens"],
                                    pb["extend_start_loc"], pb["sm_scale"], sliding_window=window)
    torch.testing.assert_close(o, expected, **ATTN_TOL)


@pytest.mark.parametrize(("kv_rows_m", "heads_first"), [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize(("fp8", "num_stages", "v_perm"), [(False, 3, False), (True, 3, False), (True, 5, False),
                                                           (True, 5, True)])
def test_decode_forms_and_grid_orders_gpu(kv_rows_m: bool, heads_first: bool, fp8: bool, num_stages: int,
                                          v_perm: bool) -> None:
    """Both dot forms and grid orders compiled for the GPU, with the split merge fused in (its counters
    raced by concurrent splits), sliding windows and an FP8 pool with the production launch configs (stages
    5: two shared buffers per KV tile; v_perm, which the M side ignores): each against the fp32 reference, and
    the fused counters left at zero for the next launch."""
    from kernels.decode_attention import decode_attention_counters

    hq, hkv, d = 32, 8, 128
    seq_lens = [1, 100, 1024, 2048, 777, 3000, 64, 5000]
    pb = _paged(seq_lens, [n - 1 for n in seq_lens], hq, hkv, d)
    k_buf, v_buf, scale = pb["k_buffer"], pb["v_buffer"], 1.0
    if fp8:
        scale = 0.5
        k_buf = (pb["k_buffer"].float() / scale).to(torch.float8_e4m3fn)
        v_buf = (pb["v_buffer"].float() / scale).to(torch.float8_e4m3fn)
    counters = decode_attention_counters(len(seq_lens), hq, "cuda")
    # 8 fused splits, and one split as a full batch runs it (where v_perm is on; stored directly on the N side)
    for (splits, fuse), window in itertools.product(((8, True), (1, False)), (0, 100, 4096)):
        o = torch.full_like(pb["q"], float("nan"))
        decode_attention_fwd(pb["q"], k_buf, v_buf, o, pb["req_to_token"], pb["req_pool_indices"], pb["seq_lens"],
                             pb["sm_scale"], num_kv_splits=splits, sliding_window=window, k_scale=scale,
                             v_scale=scale, fuse_merge=fuse, counters=counters, block_n=128, num_stages=num_stages,
                             f16_math=fp8, heads_first=heads_first, kv_rows_m=kv_rows_m, v_perm=v_perm)
        expected = decode_attention_ref(pb["q"], k_buf, v_buf, pb["req_to_token"], pb["req_pool_indices"],
                                        pb["seq_lens"], pb["sm_scale"], sliding_window=window, k_scale=scale,
                                        v_scale=scale)
        torch.testing.assert_close(o, expected, **ATTN_TOL)
        assert not counters.any()


def test_store_kv_gpu() -> None:
    t, hq, hkv, d, slots = 4096, 32, 8, 128, 20000
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=DTYPE)
    k, v = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d), qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    loc = torch.randperm(slots - 1, device="cuda")[:t] + 1
    k_buf = torch.zeros(slots, hkv, d, device="cuda", dtype=DTYPE)
    v_buf = torch.zeros_like(k_buf)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    store_kv(k_buf, v_buf, loc, k, v)
    store_kv_ref(k_ref, v_ref, loc, k, v)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)


def test_rmsnorm_gpu() -> None:
    x = torch.randn(4096, 4096, device="cuda", dtype=DTYPE)
    residual = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=DTYPE)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6))
    x_ref, r_ref = x.clone(), residual.clone()
    fused_add_rmsnorm(x, residual, w, 1e-6)
    fused_add_rmsnorm_ref(x_ref, r_ref, w, 1e-6)
    assert torch.equal(residual, r_ref)
    torch.testing.assert_close(x, x_ref)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_gpu(is_neox: bool) -> None:
    t, hq, hkv, d = 8192, 32, 8, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=DTYPE)
    q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d]
    positions = torch.randint(0, 8192, (t,), device="cuda")
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(8192, device="cuda", dtype=torch.float32), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary(positions, q, k, cache, d, is_neox=is_neox)
    apply_rotary_ref(positions, q_ref, k_ref, cache, d, is_neox=is_neox)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)


def test_silu_and_mul_gpu() -> None:
    x = torch.randn(4096, 2 * 14336, device="cuda", dtype=DTYPE)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x))


@pytest.mark.parametrize("rows", [1, 8, 256])
def test_lm_head_direct_buffer_write_is_bit_equal_gpu(rows: int) -> None:
    """A decode graph's LM head writes its shared logits buffer through torch.matmul(out=): the same cuBLAS
    call as F.linear, so the same bits (rows 1 takes the GEMV and comes back fresh, the caller copies)."""
    from runtime.distributed import ParallelGroup
    from runtime.layers.embedding import ParallelLMHead

    torch.manual_seed(0)
    head = ParallelLMHead(32000, 2048, ParallelGroup.single(), DTYPE).cuda()
    head.weight.data.normal_(0, 0.02)
    hidden = torch.randn(rows, 2048, device="cuda", dtype=DTYPE)
    fresh = head.compute_logits(hidden)
    buf = torch.full((rows, 32000), float("nan"), device="cuda", dtype=DTYPE)
    out = head.compute_logits(hidden, out=buf)
    assert (out.data_ptr() == buf.data_ptr()) == (rows > 1)
    assert torch.equal(out, fresh)

