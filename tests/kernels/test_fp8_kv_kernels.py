"""FP8 (float8_e4m3fn) KV buffers through the Triton kernels (interpreter on CPU, fp32 compute): the store
quantizes exactly like the torch reference, and decode/extend read stored * scale exactly like theirs."""

import os

import pytest
import torch

from kernels.decode_attention import decode_attention_fwd, decode_attention_ref
from kernels.extend_attention import extend_attention_fwd, extend_attention_ref
from kernels.kv_store import store_kv, store_kv_ref
from runtime.mem_cache.kv_quant import dequantize_kv, quantize_kv

F8 = torch.float8_e4m3fn


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_store_kv_fp8_quantizes_like_reference(scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    t, hkv, d = 9, 2, 24
    k, v = torch.randn(t, hkv, d, generator=gen) * 4, torch.randn(t, hkv, d, generator=gen)
    k[0, 0, 0] = 1e4  # saturates to +448 instead of becoming NaN
    loc = torch.tensor([3, 7, 1, 12, 5, 9, 2, 14, 11])
    bufs = [torch.zeros(16, hkv, d, dtype=F8) for _ in range(4)]
    store_kv(bufs[0], bufs[1], loc, k, v, scale, scale)
    store_kv_ref(bufs[2], bufs[3], loc, k, v, scale, scale)
    assert torch.equal(bufs[2][loc].view(torch.uint8), quantize_kv(k, scale, F8).view(torch.uint8))
    for got, want in ((bufs[0], bufs[2]), (bufs[1], bufs[3])):
        _assert_same_fp8(got, want)
    assert float(bufs[0][3, 0, 0].float()) == 448.0
    back = dequantize_kv(bufs[2][loc], scale, torch.float32)
    err = (back - k)[k.abs() < 400 * scale].abs() / k[k.abs() < 400 * scale].abs().clamp(min=scale * 2**-6)
    assert float(err.max()) <= 2**-4 + 1e-6  # e4m3: 3 mantissa bits, round to nearest


def _assert_same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal on a GPU. The Triton interpreter's own fp32 -> e4m3 cast (numpy emulation) mis-rounds
    values that round up to a power of two and some subnormals (0.48 -> 0.25, not 0.5): there only a
    few elements may differ there, each rounded toward zero instead."""
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    if os.environ.get("TRITON_INTERPRET") == "1":
        g, w = got.float()[differ], want.float()[differ]
        assert differ.float().mean() < 0.05
        assert bool((g.abs() <= w.abs()).all() and (g * w >= 0).all())
    else:
        assert not differ.any()


def _fp8_batch(pb, scale: float):
    """The paged batch's buffers quantized to fp8 with `scale`."""
    return quantize_kv(pb.k_buffer, scale, F8), quantize_kv(pb.v_buffer, scale, F8)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 32), (9, 3, 24)])
def test_decode_fp8_matches_reference(paged_batch, hq: int, hkv: int, d: int) -> None:
    pb = paged_batch([1, 37, 100, 64], [0, 36, 99, 63], hq, hkv, d)
    scale = 0.5
    k8, v8 = _fp8_batch(pb, scale)
    o = torch.full_like(pb.q, float("nan"))
    decode_attention_fwd(pb.q, k8, v8, o, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, pb.sm_scale,
                         num_kv_splits=4, k_scale=scale, v_scale=scale)
    ref = decode_attention_ref(pb.q, k8, v8, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, pb.sm_scale,
                               k_scale=scale, v_scale=scale)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
    # And the quantization error itself is small against the unquantized buffers.
    exact = decode_attention_ref(pb.q, pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices,
                                 pb.seq_lens, pb.sm_scale)
    assert float((o - exact).abs().max()) < 0.1


def test_extend_fp8_prefix_matches_reference(paged_batch) -> None:
    pb = paged_batch([12, 70, 5], [5, 64, 0], 4, 2, 16)
    scale = 2.0
    k8, v8 = _fp8_batch(pb, scale)
    o = torch.full_like(pb.q, float("nan"))
    extend_attention_fwd(pb.q, pb.k, pb.v, o, k8, v8, pb.req_to_token, pb.req_pool_indices, pb.seq_lens,
                         pb.prefix_lens, pb.extend_start_loc, pb.max_extend_len, pb.sm_scale,
                         k_scale=scale, v_scale=scale)
    ref = extend_attention_ref(pb.q, pb.k, pb.v, k8, v8, pb.req_to_token, pb.req_pool_indices, pb.seq_lens,
                               pb.prefix_lens, pb.extend_start_loc, pb.sm_scale, k_scale=scale, v_scale=scale)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("splits", "fuse", "kv_rows_m"), [(1, False, False), (2, True, False), (8, True, False),
                                                        (1, True, True), (2, True, True)])
def test_decode_fp8_f16_math_config_matches_reference(paged_batch, splits: int, fuse: bool, kv_rows_m: bool
                                                      ) -> None:
    """The FP8 launch config (runtime/attention/triton_decode.py: fp16 math, 128-token tiles, 5 stages, V's
    channels permuted in one-split N-side launches; K/V tiles on either side of the dots) against the fp32
    reference: q and the probabilities rounded to fp16 (11 bits) on the way in."""
    pb = paged_batch([1, 37, 300, 129], [0, 36, 299, 128], 8, 2, 32)
    pb.q = pb.q.half()  # fp16 math serves 16-bit queries (fp32 ones keep fp32 math)
    scale = 0.5
    k8, v8 = _fp8_batch(pb, scale)
    o = torch.full_like(pb.q, float("nan"))
    decode_attention_fwd(pb.q, k8, v8, o, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, pb.sm_scale,
                         num_kv_splits=splits, k_scale=scale, v_scale=scale, fuse_merge=fuse, block_n=128,
                         num_stages=5, f16_math=True, kv_rows_m=kv_rows_m, v_perm=splits == 1 and not kv_rows_m)
    ref = decode_attention_ref(pb.q, k8, v8, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, pb.sm_scale,
                               k_scale=scale, v_scale=scale)
    torch.testing.assert_close(o.float(), ref.float(), atol=3e-3, rtol=3e-3)
    # 16-bit KV ignores f16_math (its own dtype is the math): the same bits as without it.
    o16, o16_plain = torch.empty_like(pb.q), torch.empty_like(pb.q)
    for out, f16 in ((o16, True), (o16_plain, False)):
        decode_attention_fwd(pb.q, pb.k_buffer.half(), pb.v_buffer.half(), out, pb.req_to_token, pb.req_pool_indices,
                             pb.seq_lens, pb.sm_scale, num_kv_splits=splits, f16_math=f16)
    assert torch.equal(o16, o16_plain)


def test_decode_fp8_f16_math_clamps_queries_beyond_fp16(paged_batch) -> None:
    """A bf16 query beyond fp16's range saturates instead of turning the scores into inf/NaN."""
    pb = paged_batch([5, 40], [4, 39], 4, 2, 32)
    k8, v8 = _fp8_batch(pb, 1.0)
    q = pb.q.to(torch.bfloat16)
    q[:, 0, 0] = 1e6
    o = torch.full_like(q, float("nan"))
    decode_attention_fwd(q, k8, v8, o, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, pb.sm_scale,
                         num_kv_splits=1, f16_math=True)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize(("d", "splits", "fuse", "window"), [(32, 1, False, 0), (32, 2, True, 0), (24, 4, False, 50),
                                                              (24, 1, False, 0)])
def test_decode_fp8_v_perm_gives_the_same_bits(paged_batch, d: int, splits: int, fuse: bool, window: int) -> None:
    """v_perm (FP8, N side): each V tile's channels are permuted in registers so a thread's P V operand is whole
    32-bit words instead of bytes, and the output columns un-permuted at the store: the same arithmetic per
    channel, so the same bits, with one split (stored directly) or several (merged, fused or not), a window,
    and a head size padded to the tile (24 in 32)."""
    pb = paged_batch([1, 37, 300, 129], [0, 36, 299, 128], 8, 2, d)
    pb.q = pb.q.half()
    k8, v8 = _fp8_batch(pb, 0.5)
    outs = []
    for v_perm in (False, True):
        o = torch.full_like(pb.q, float("nan"))
        decode_attention_fwd(pb.q, k8, v8, o, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, pb.sm_scale,
                             num_kv_splits=splits, sliding_window=window, k_scale=0.5, v_scale=0.5, fuse_merge=fuse,
                             block_n=128, num_stages=5, f16_math=True, v_perm=v_perm)
        outs.append(o)
    assert not outs[1].isnan().any()
    assert torch.equal(outs[0], outs[1])
