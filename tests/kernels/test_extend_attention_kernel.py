import pytest
import torch

from kernels.extend_attention import extend_attention_fwd, extend_attention_ref


def _run(pb) -> torch.Tensor:
    o = torch.full_like(pb.q, float("nan"))
    extend_attention_fwd(pb.q, pb.k, pb.v, o, pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices,
                         pb.seq_lens, pb.prefix_lens, pb.extend_start_loc, pb.max_extend_len, pb.sm_scale)
    return o


def _ref(pb) -> torch.Tensor:
    return extend_attention_ref(pb.q, pb.k, pb.v, pb.k_buffer, pb.v_buffer, pb.req_to_token,
                                pb.req_pool_indices, pb.seq_lens, pb.prefix_lens, pb.extend_start_loc,
                                pb.sm_scale)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 32), (4, 4, 32), (9, 3, 24)])
def test_extend_matches_reference(paged_batch, hq: int, hkv: int, d: int) -> None:
    # Requests: no prefix with one new token; short prefix; prefix longer than a 64-key block with more
    # than one 64-row query block of new tokens; no prefix and a ragged 67-token prompt.
    pb = paged_batch([1, 6, 150, 67], [0, 5, 70, 0], hq, hkv, d)
    torch.testing.assert_close(_run(pb), _ref(pb), atol=1e-5, rtol=1e-5)


def test_extend_without_prefix_is_causal_self_attention(paged_batch) -> None:
    pb = paged_batch([9, 4], [0, 0], 4, 2, 16)
    o = _run(pb)
    for b, (start, n) in enumerate([(0, 9), (9, 4)]):
        q = pb.q[start:start + n].transpose(0, 1)
        k = pb.k[start:start + n].repeat_interleave(2, dim=1).transpose(0, 1)
        v = pb.v[start:start + n].repeat_interleave(2, dim=1).transpose(0, 1)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(o[start:start + n], expected.transpose(0, 1), atol=1e-5, rtol=1e-5,
                                   msg=f"request {b}")


def test_extend_reads_new_tokens_from_k_v_not_buffers(paged_batch) -> None:
    pb = paged_batch([12, 20], [4, 0], 4, 2, 16)
    expected = _run(pb)
    for b in range(2):
        row = pb.req_to_token[pb.req_pool_indices[b]]
        new_slots = row[int(pb.prefix_lens[b]):int(pb.seq_lens[b])].long()
        pb.k_buffer[new_slots] = 1e4
        pb.v_buffer[new_slots] = 1e4
    torch.testing.assert_close(_run(pb), expected)


def test_extend_prefix_changes_output(paged_batch) -> None:
    # Same new tokens with and without a cached prefix must differ: the prefix is really attended to.
    pb = paged_batch([10], [6], 2, 2, 16)
    with_prefix = _run(pb)
    pb.k_buffer[pb.req_to_token[pb.req_pool_indices[0], :6].long()] *= -1
    assert not torch.allclose(_run(pb), with_prefix, atol=1e-3)
    torch.testing.assert_close(_run(pb), _ref(pb), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 64, 100, 1000])
def test_extend_sliding_window_matches_reference(paged_batch, window: int) -> None:
    # Windows shorter than a block, equal to one, spanning the prefix/new boundary and longer than all.
    pb = paged_batch([1, 6, 150, 67, 200], [0, 5, 70, 0, 130], 4, 2, 32)
    o = torch.full_like(pb.q, float("nan"))
    extend_attention_fwd(pb.q, pb.k, pb.v, o, pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices,
                         pb.seq_lens, pb.prefix_lens, pb.extend_start_loc, pb.max_extend_len, pb.sm_scale,
                         sliding_window=window)
    ref = extend_attention_ref(pb.q, pb.k, pb.v, pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices,
                               pb.seq_lens, pb.prefix_lens, pb.extend_start_loc, pb.sm_scale, sliding_window=window)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


def test_extend_sliding_window_reference_matches_sdpa_band_mask(paged_batch) -> None:
    pb = paged_batch([30], [0], 4, 2, 16)
    window = 6
    ref = extend_attention_ref(pb.q, pb.k, pb.v, pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices,
                               pb.seq_lens, pb.prefix_lens, pb.extend_start_loc, pb.sm_scale, sliding_window=window)
    i = torch.arange(30)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    q = pb.q.transpose(0, 1)
    k = pb.k.repeat_interleave(2, dim=1).transpose(0, 1)
    v = pb.v.repeat_interleave(2, dim=1).transpose(0, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=pb.sm_scale)
    torch.testing.assert_close(ref, expected.transpose(0, 1), atol=1e-5, rtol=1e-5)
