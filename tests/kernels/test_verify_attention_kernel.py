"""verify_attention_fwd (a few causal new tokens per request over paged KV) against the plain fp32
reference of the extend kernel, which computes the same attention from the same inputs."""

import pytest
import torch

from kernels.extend_attention import extend_attention_ref
from kernels.verify_attention import verify_attention_fwd, verify_attention_workspace


def _run(pb, num_kv_splits: int = 4, sliding_window: int = 0, workspace=None) -> torch.Tensor:
    o = torch.full_like(pb.q, float("nan"))
    verify_attention_fwd(pb.q, pb.k_buffer, pb.v_buffer, o, pb.req_to_token, pb.req_pool_indices, pb.seq_lens,
                         pb.prefix_lens, pb.extend_start_loc, pb.max_extend_len, pb.sm_scale,
                         num_kv_splits=num_kv_splits, workspace=workspace, sliding_window=sliding_window)
    return o


def _ref(pb, sliding_window: int = 0) -> torch.Tensor:
    return extend_attention_ref(pb.q, pb.k, pb.v, pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices,
                                pb.seq_lens, pb.prefix_lens, pb.extend_start_loc, pb.sm_scale,
                                sliding_window=sliding_window)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 32), (4, 4, 32), (9, 3, 24)])
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_verify_matches_reference(paged_batch, hq: int, hkv: int, d: int, num_kv_splits: int) -> None:
    # K + 1 = 5 new tokens; prefixes not multiples of the 32-token split or 64-token block; one prefix of 0.
    seq = [5, 42, 105, 69]
    pb = paged_batch(seq, [s - 5 for s in seq], hq, hkv, d)
    torch.testing.assert_close(_run(pb, num_kv_splits), _ref(pb), atol=1e-5, rtol=1e-5)


def test_verify_ragged_new_tokens(paged_batch) -> None:
    # Eager verify steps may give requests different draft counts (1 to 4 drafts, or none).
    pb = paged_batch([40, 9, 70, 33], [36, 8, 67, 32], 8, 2, 32)
    torch.testing.assert_close(_run(pb, 3), _ref(pb), atol=1e-5, rtol=1e-5)


def test_verify_large_group_splits_heads_over_programs(paged_batch) -> None:
    # 20 q heads per KV head x 5 tokens = 100 rows > MAX_ROWS: heads go to several programs per KV head.
    pb = paged_batch([50, 12], [45, 7], 40, 2, 16)
    ws = verify_attention_workspace(16, 40, 16, 2, "cpu")  # more tokens than used: allowed
    torch.testing.assert_close(_run(pb, 2, workspace=ws), _ref(pb), atol=1e-5, rtol=1e-5)


def test_verify_sliding_window(paged_batch) -> None:
    # A window of 16: the last tokens' first chunk holds no visible key for them (merged as empty).
    pb = paged_batch([90, 20], [86, 15], 4, 2, 16)
    torch.testing.assert_close(_run(pb, 4, sliding_window=16), _ref(pb, sliding_window=16), atol=1e-5, rtol=1e-5)


def test_verify_fp16(paged_batch) -> None:
    pb = paged_batch([70, 37], [65, 32], 8, 2, 64, dtype=torch.float16)
    torch.testing.assert_close(_run(pb, 4).float(), _ref(pb).float(), atol=2e-3, rtol=2e-3)


def test_verify_rejects_too_many_tokens_and_bad_workspace(paged_batch) -> None:
    pb = paged_batch([10], [5], 4, 2, 16)
    with pytest.raises(ValueError, match="at most"):
        verify_attention_fwd(pb.q, pb.k_buffer, pb.v_buffer, torch.empty_like(pb.q), pb.req_to_token,
                             pb.req_pool_indices, pb.seq_lens, pb.prefix_lens, pb.extend_start_loc, 65, pb.sm_scale)
    with pytest.raises(ValueError, match="workspace"):
        _run(pb, 4, workspace=verify_attention_workspace(5, 4, 16, 2, "cpu"))


def test_verify_fp8_pool_matches_reference(paged_batch) -> None:
    # FP8 pool: every key, the new tokens' too, is read as stored * scale (what later steps will see).
    from runtime.mem_cache.kv_quant import dequantize_kv, quantize_kv

    pb = paged_batch([70, 12], [65, 7], 8, 2, 32)
    scale = 0.5
    k8, v8 = quantize_kv(pb.k_buffer, scale, torch.float8_e4m3fn), quantize_kv(pb.v_buffer, scale, torch.float8_e4m3fn)
    new = torch.cat([pb.req_to_token[int(r), int(p):int(s)].long()
                     for r, p, s in zip(pb.req_pool_indices, pb.prefix_lens, pb.seq_lens)])
    o = torch.full_like(pb.q, float("nan"))
    verify_attention_fwd(pb.q, k8, v8, o, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, pb.prefix_lens,
                         pb.extend_start_loc, pb.max_extend_len, pb.sm_scale, num_kv_splits=3,
                         k_scale=scale, v_scale=scale)
    ref = extend_attention_ref(pb.q, dequantize_kv(k8[new], scale, torch.float32),
                               dequantize_kv(v8[new], scale, torch.float32), k8, v8, pb.req_to_token,
                               pb.req_pool_indices, pb.seq_lens, pb.prefix_lens, pb.extend_start_loc, pb.sm_scale,
                               k_scale=scale, v_scale=scale)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
