"""TritonDecode (runtime/attention/triton_decode.py): the split count by batch, the per-KV-dtype launch
config, one flat workspace viewed per launch (and grown, never shrunk), run in the Triton interpreter
against the reference."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kernels.decode_attention import decode_attention_ref
from runtime.attention.spec import AttentionSpec
from runtime.attention.triton_decode import (
    DEFAULT_NUM_KV_SPLITS,
    DecodeKernelConfig,
    TritonDecode,
    splits_for,
)


@pytest.mark.parametrize(("bs", "kv_heads", "want"), [(1, 8, 8), (2, 8, 8), (4, 8, 4), (8, 8, 2), (9, 8, 1),
                                                      (16, 8, 1), (64, 8, 1), (256, 8, 1), (1, 1, 8), (33, 4, 1),
                                                      (32, 4, 1), (16, 4, 2)])
def test_splits_fill_the_gpu_then_stop(bs: int, kv_heads: int, want: int) -> None:
    assert splits_for(bs, kv_heads, max_splits=8, sm_count=132) == want


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "programs"), [(32, 8, 8), (4, 2, 2), (32, 1, 2), (64, 2, 4), (48, 1, 3)])
def test_splits_count_a_groups_head_blocks(num_heads: int, num_kv_heads: int, programs: int) -> None:
    """A program takes up to 16 query heads of a KV head's group, so a group of 32 takes two a split."""
    spec = dataclasses.replace(_spec(4, None), num_heads=num_heads, num_kv_heads=num_kv_heads)
    decode = TritonDecode(spec, DecodeKernelConfig.for_kv(False))
    assert decode.head_programs == programs
    assert decode.splits(40) == splits_for(40, programs, decode.config.max_splits, decode.sm_count)


def test_config_per_kv_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SHOAL_DECODE_GRID", "SHOAL_DECODE_KV_SIDE", "SHOAL_DECODE_MAX_SPLITS", "SHOAL_DECODE_LAUNCH",
                 "SHOAL_DECODE_V_PERM"):
        monkeypatch.delenv(name, raising=False)
    fp8 = DecodeKernelConfig.for_kv(kv_fp8=True)
    assert fp8.f16_math and fp8.adaptive_splits and (fp8.block_n, fp8.num_warps, fp8.num_stages) == (128, 4, 5)
    bf16 = DecodeKernelConfig.for_kv(kv_fp8=False)  # bf16 math (bf16 → fp16 rounds); one shared KV buffer
    assert not bf16.f16_math and bf16.adaptive_splits and bf16.max_splits == DEFAULT_NUM_KV_SPLITS
    assert (bf16.block_n, bf16.num_warps, bf16.num_stages) == (128, 4, 3)
    # The sweeps' picks: both as the dots' N side, in the heads-first grid.
    assert (fp8.kv_rows_m, fp8.heads_first, bf16.kv_rows_m, bf16.heads_first) == (False, True, False, True)
    assert fp8.v_perm and not bf16.v_perm  # V's channels permuted: FP8 only (16-bit tiles load by ldmatrix)


def test_config_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_DECODE_GRID", "batch")
    monkeypatch.setenv("SHOAL_DECODE_KV_SIDE", "m")
    fp8 = DecodeKernelConfig.for_kv(kv_fp8=True)
    assert not fp8.heads_first and fp8.kv_rows_m
    monkeypatch.setenv("SHOAL_DECODE_KV_SIDE", "sideways")
    with pytest.raises(ValueError, match="SHOAL_DECODE_KV_SIDE must be auto or one of n, m"):
        DecodeKernelConfig.for_kv(kv_fp8=True)
    monkeypatch.delenv("SHOAL_DECODE_KV_SIDE")
    monkeypatch.setenv("SHOAL_DECODE_LAUNCH", "bn64_w8_st5")
    bf16 = DecodeKernelConfig.for_kv(kv_fp8=False)
    assert (bf16.block_n, bf16.num_warps, bf16.num_stages) == (64, 8, 5)
    monkeypatch.setenv("SHOAL_DECODE_LAUNCH", "bn100_w4_st3")
    with pytest.raises(ValueError, match="SHOAL_DECODE_LAUNCH must be auto or bn"):
        DecodeKernelConfig.for_kv(kv_fp8=True)
    monkeypatch.delenv("SHOAL_DECODE_LAUNCH")
    monkeypatch.setenv("SHOAL_DECODE_V_PERM", "0")
    assert not DecodeKernelConfig.for_kv(kv_fp8=True).v_perm


def _spec(max_bs: int, kv_dtype: torch.dtype | None) -> AttentionSpec:
    req_to_token = torch.arange(4 * 64, dtype=torch.int32).view(4, 64) + 1
    return AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25, dtype=torch.float32,
                         device=torch.device("cpu"), req_to_token=req_to_token, max_bs=max_bs, kv_dtype=kv_dtype)


@pytest.mark.parametrize("fp8", [False, True])
def test_call_matches_reference_and_workspace_grows(fp8: bool) -> None:
    spec = _spec(max_bs=2, kv_dtype=torch.float8_e4m3fn if fp8 else None)
    decode = TritonDecode(spec, DecodeKernelConfig.for_kv(fp8))
    gen = torch.Generator().manual_seed(0)
    slots = 4 * 64 + 1
    k_buf, v_buf = (torch.randn(slots, 2, 16, generator=gen) for _ in range(2))
    if fp8:
        k_buf, v_buf = k_buf.to(torch.float8_e4m3fn), v_buf.to(torch.float8_e4m3fn)
    layer = SimpleNamespace(num_heads=4, head_dim=16, scaling=0.25, sliding_window=0)
    decode.reserve(1)
    first = decode._workspace
    assert first is not None and first.numel() == 2 * 4 * DEFAULT_NUM_KV_SPLITS * 17  # sized for spec.max_bs
    for bs in (1, 3):  # 3 > max_bs: the workspace grows for the eager batch
        fb = SimpleNamespace(req_pool_indices=torch.arange(bs), seq_lens=torch.tensor([5, 64, 33][:bs]))
        q = torch.randn(bs, 4 * 16, generator=gen)
        o = decode(q, k_buf, v_buf, layer, fb, 0.5, 0.5, fuse_merge=True)
        ref = decode_attention_ref(q.view(bs, 4, 16), k_buf, v_buf, spec.req_to_token, fb.req_pool_indices,
                                   fb.seq_lens, 0.25, k_scale=0.5, v_scale=0.5)
        torch.testing.assert_close(o.view(bs, 4, 16), ref, atol=1e-5, rtol=1e-5)
    assert decode.max_bs == 3 and decode._workspace.numel() == 3 * 4 * DEFAULT_NUM_KV_SPLITS * 17


@pytest.mark.parametrize(("max_splits", "sm_count", "want_perm"), [(1, 1, True), (8, 132, False), (1, 132, False)])
def test_fp8_call_permutes_v_only_in_one_split_launches(monkeypatch: pytest.MonkeyPatch, max_splits: int,
                                                        sm_count: int, want_perm: bool) -> None:
    """v_perm goes to the kernel where one split serves a request and the programs fill the SMs at least 4
    times over (where it measured faster), and the output still matches the reference."""
    import runtime.attention.triton_decode as td

    monkeypatch.delenv("SHOAL_DECODE_V_PERM", raising=False)
    seen: list[bool] = []
    real = td.decode_attention_fwd

    def spy(*args, **kwargs):
        seen.append(kwargs["v_perm"])
        return real(*args, **kwargs)

    monkeypatch.setattr(td, "decode_attention_fwd", spy)
    spec = _spec(max_bs=2, kv_dtype=torch.float8_e4m3fn)
    decode = TritonDecode(spec, DecodeKernelConfig.for_kv(True, num_kv_splits=max_splits))
    decode.sm_count = sm_count  # 2 requests x 2 KV heads: 4 programs, 4 an SM on one SM
    gen = torch.Generator().manual_seed(1)
    k_buf, v_buf = (torch.randn(4 * 64 + 1, 2, 16, generator=gen).to(torch.float8_e4m3fn) for _ in range(2))
    layer = SimpleNamespace(num_heads=4, head_dim=16, scaling=0.25, sliding_window=0)
    fb = SimpleNamespace(req_pool_indices=torch.arange(2), seq_lens=torch.tensor([64, 33]))
    q = torch.randn(2, 4 * 16, generator=gen).to(torch.bfloat16)
    o = decode(q, k_buf, v_buf, layer, fb, 0.5, 0.5, fuse_merge=True)
    ref = decode_attention_ref(q.view(2, 4, 16), k_buf, v_buf, spec.req_to_token, fb.req_pool_indices, fb.seq_lens,
                               0.25, k_scale=0.5, v_scale=0.5)
    assert seen == [want_perm]
    torch.testing.assert_close(o.view(2, 4, 16).float(), ref.float(), atol=2e-2, rtol=2e-2)
