import pytest
import torch

from kernels.decode_attention import decode_attention_fwd, decode_attention_ref, decode_attention_workspace


def _decode_batch(paged_batch, seq_lens: list[int], hq: int, hkv: int, d: int):
    return paged_batch(seq_lens, [n - 1 for n in seq_lens], hq, hkv, d)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 32), (4, 4, 32), (9, 3, 24)])
@pytest.mark.parametrize("num_kv_splits", [1, 4])
@pytest.mark.parametrize("kv_rows_m", [False, True])
def test_decode_matches_reference(paged_batch, hq: int, hkv: int, d: int, num_kv_splits: int, kv_rows_m: bool
                                  ) -> None:
    # 1: a single token; 37/100: not multiples of the 32-token split granularity or 64-token block.
    # kv_rows_m: the K/V tiles as the dots' M side (scores transposed), the same attention.
    pb = _decode_batch(paged_batch, [1, 37, 100, 64], hq, hkv, d)
    o = torch.full_like(pb.q, float("nan"))
    decode_attention_fwd(pb.q, pb.k_buffer, pb.v_buffer, o, pb.req_to_token, pb.req_pool_indices,
                         pb.seq_lens, pb.sm_scale, num_kv_splits=num_kv_splits, kv_rows_m=kv_rows_m)
    ref = decode_attention_ref(pb.q, pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices,
                               pb.seq_lens, pb.sm_scale)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


def test_decode_seq_len_one_returns_that_tokens_value(paged_batch) -> None:
    pb = _decode_batch(paged_batch, [1, 1], 4, 2, 16)
    o = torch.empty_like(pb.q)
    decode_attention_fwd(pb.q, pb.k_buffer, pb.v_buffer, o, pb.req_to_token, pb.req_pool_indices,
                         pb.seq_lens, pb.sm_scale)
    # Softmax over one key is 1: each q head returns its KV head's V row exactly.
    torch.testing.assert_close(o, pb.v.repeat_interleave(2, dim=1))


def test_decode_large_gqa_group_and_caller_workspace(paged_batch) -> None:
    # A group of 20 q heads per KV head needs two head blocks of 16 per KV head.
    pb = _decode_batch(paged_batch, [50, 3], 40, 2, 16)
    workspace = decode_attention_workspace(4, 40, 16, 2, "cpu")  # larger batch than used: allowed
    o = torch.empty_like(pb.q)
    decode_attention_fwd(pb.q, pb.k_buffer, pb.v_buffer, o, pb.req_to_token, pb.req_pool_indices,
                         pb.seq_lens, pb.sm_scale, num_kv_splits=2, attn_logits=workspace)
    ref = decode_attention_ref(pb.q, pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices,
                               pb.seq_lens, pb.sm_scale)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_kv_splits", [1, 2])  # 1: stage 1 writes the output itself
def test_decode_zero_length_padding_request_gives_zeros(paged_batch, num_kv_splits: int) -> None:
    pb = _decode_batch(paged_batch, [5, 9], 4, 2, 16)
    seq_lens = torch.tensor([5, 0])
    o = torch.full_like(pb.q, float("nan"))
    decode_attention_fwd(pb.q, pb.k_buffer, pb.v_buffer, o, pb.req_to_token, pb.req_pool_indices,
                         seq_lens, pb.sm_scale, num_kv_splits=num_kv_splits)
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    ref = decode_attention_ref(pb.q, pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices,
                               seq_lens, pb.sm_scale)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


def test_decode_rejects_mismatched_workspace(paged_batch) -> None:
    pb = _decode_batch(paged_batch, [3], 4, 2, 16)
    with pytest.raises(ValueError, match="attn_logits"):
        decode_attention_fwd(pb.q, pb.k_buffer, pb.v_buffer, torch.empty_like(pb.q), pb.req_to_token,
                             pb.req_pool_indices, pb.seq_lens, pb.sm_scale, num_kv_splits=4,
                             attn_logits=decode_attention_workspace(1, 4, 16, 2, "cpu"))


@pytest.mark.parametrize(("window", "num_kv_splits", "kv_rows_m"), [
    *((w, s, False) for w in (1, 5, 33, 64, 500) for s in (1, 4)), (1, 4, True), (33, 4, True), (500, 1, True)])
def test_decode_sliding_window_matches_reference(paged_batch, window: int, num_kv_splits: int, kv_rows_m: bool
                                                 ) -> None:
    pb = _decode_batch(paged_batch, [1, 37, 100, 64], 4, 2, 32)
    o = torch.full_like(pb.q, float("nan"))
    decode_attention_fwd(pb.q, pb.k_buffer, pb.v_buffer, o, pb.req_to_token, pb.req_pool_indices,
                         pb.seq_lens, pb.sm_scale, num_kv_splits=num_kv_splits, sliding_window=window,
                         kv_rows_m=kv_rows_m)
    ref = decode_attention_ref(pb.q, pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices,
                               pb.seq_lens, pb.sm_scale, sliding_window=window)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


def test_decode_sliding_window_reference_is_attention_over_the_last_tokens(paged_batch) -> None:
    # The windowed reference equals the full reference over a table that holds only the last W tokens.
    pb = _decode_batch(paged_batch, [1, 37, 100], 4, 2, 16)
    window = 10
    table = torch.zeros_like(pb.req_to_token)
    lens = []
    for b, n in enumerate(pb.seq_lens.tolist()):
        row = int(pb.req_pool_indices[b])
        first = max(0, n - window)
        table[row, :n - first] = pb.req_to_token[row, first:n]
        lens.append(n - first)
    full = decode_attention_ref(pb.q, pb.k_buffer, pb.v_buffer, table, pb.req_pool_indices,
                                torch.tensor(lens), pb.sm_scale)
    windowed = decode_attention_ref(pb.q, pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices,
                                    pb.seq_lens, pb.sm_scale, sliding_window=window)
    torch.testing.assert_close(windowed, full)


@pytest.mark.parametrize(("hq", "hkv", "d", "window", "splits"), [
    (4, 2, 32, 0, 4), (9, 3, 24, 0, 8), (40, 2, 16, 0, 2), (4, 2, 32, 20, 4), (8, 1, 16, 0, 1)])
def test_fused_merge_is_bit_equal_to_two_stages(paged_batch, hq, hkv, d, window, splits) -> None:
    """fuse_merge (stage 2 done by the last split of each request and head block) gives the same bits as
    the two launches, with empty splits (short sequences, zero-length padding rows), a sliding window, GQA
    groups over 16 heads, and the counters back at zero after each call so the next call reuses them; the
    heads-first grid order (last call) changes only which program runs where. (The interpreter runs programs one
    at a time: this checks the swapped indices, not the counters under concurrent splits; the GPU tests do.)"""
    from kernels.decode_attention import decode_attention_counters

    pb = _decode_batch(paged_batch, [1, 37, 100, 64, 5], hq, hkv, d)
    seq_lens = pb.seq_lens.clone()
    seq_lens[-1] = 0
    counters = decode_attention_counters(8, hq, "cpu")
    outs = []
    for fuse, heads_first in ((False, False), (True, False), (True, False), (True, True)):
        o = torch.full_like(pb.q, float("nan"))
        decode_attention_fwd(pb.q, pb.k_buffer, pb.v_buffer, o, pb.req_to_token, pb.req_pool_indices, seq_lens,
                             pb.sm_scale, num_kv_splits=splits, sliding_window=window, fuse_merge=fuse,
                             counters=counters, heads_first=heads_first)
        assert not counters.any()
        outs.append(o)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert torch.equal(outs[1][-1], torch.zeros_like(outs[1][-1]))


@pytest.mark.parametrize("kv_rows_m", [False, True])
def test_single_split_direct_store_is_bit_equal_to_a_merge(paged_batch, kv_rows_m: bool) -> None:
    """One split stores its output straight from stage 1 (no scratch, counter or merge). At <= 32 tokens two
    splits leave the second empty, so their merge (two launches, or fused) is of that same one partial: the
    bits must agree."""
    pb = _decode_batch(paged_batch, [1, 17, 32, 9], 8, 2, 32)
    outs = []
    for splits, fuse in ((1, False), (1, True), (2, False), (2, True)):
        o = torch.full_like(pb.q, float("nan"))
        decode_attention_fwd(pb.q, pb.k_buffer, pb.v_buffer, o, pb.req_to_token, pb.req_pool_indices,
                             pb.seq_lens, pb.sm_scale, num_kv_splits=splits, fuse_merge=fuse, kv_rows_m=kv_rows_m)
        outs.append(o)
    assert not outs[0].isnan().any()
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_fused_merge_rejects_small_counters(paged_batch) -> None:
    from kernels.decode_attention import decode_attention_counters

    pb = _decode_batch(paged_batch, [3, 4], 4, 2, 16)
    with pytest.raises(ValueError, match="counters"):
        decode_attention_fwd(pb.q, pb.k_buffer, pb.v_buffer, torch.empty_like(pb.q), pb.req_to_token,
                             pb.req_pool_indices, pb.seq_lens, pb.sm_scale, fuse_merge=True,
                             counters=decode_attention_counters(1, 4, "cpu"))
