"""The flashinfer backend's ragged prefill (runtime/attention/ragged_prefill.py), planned and run on CPU over a
stand-in flashinfer that computes what the real wrappers compute (causal masks aligned to the end of the
keys, log2 log-sum-exp, merge_state_in_place with a row mask): each new token attends to its request's cached
prefix as the FP8 pool holds it and to the new tokens up to itself as the layer computed them; the new K/V are
stored in the pool too; the paged part covers only the requests from the first to the last with a prefix;
SHOAL_PREFILL_RAGGED=0 keeps the paged prefill over every key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from flashinfer_stub import flashinfer_backend_cls

from kernels.kv_store import store_kv_ref
from runtime.attention.spec import AttentionSpec
from runtime.model_executor.forward_mode import ForwardMode

HQ, HKV, D, SLOTS = 4, 2, 64, 200
K_SCALE, V_SCALE = 0.5, 0.25


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: q [m, Hq, D] over k/v [n, Hkv, D] → o [m, Hq, D], lse [m, Hq] (log2); an empty k gives
    o = 0 and lse = -inf, as flashinfer's kernels write."""
    m, n = q.shape[0], k.shape[0]
    if n == 0:
        return torch.zeros_like(q), torch.full(q.shape[:2], float("-inf"))
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = torch.einsum("mhd,nhd->hmn", q.float(), k) * sm_scale
    if causal:  # row i sees keys up to i + (n - m): the new tokens sit at the end of the keys
        s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(m)[:, None] + (n - m), float("-inf"))
    lse = torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0))
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), v).to(q.dtype), lse.transpose(0, 1).contiguous()


class _Ragged:
    def __init__(self, workspace, layout, backend="auto") -> None:
        self.backend = backend

    def plan(self, qo_indptr, kv_indptr, hq, hkv, d, causal=False, sm_scale=None, q_data_type=None,
             kv_data_type=None) -> None:
        assert kv_data_type == q_data_type  # the new tokens' K/V as computed, never the pool's dtype
        self.qo, self.kv, self.causal, self.sm_scale = qo_indptr.tolist(), kv_indptr.tolist(), causal, sm_scale

    def run(self, q, k, v, return_lse=False):
        outs = [_attend(q[a:b], k[c:e], v[c:e], self.sm_scale, self.causal)
                for a, b, c, e in zip(self.qo, self.qo[1:], self.kv, self.kv[1:])]
        return torch.cat([o for o, _ in outs]), torch.cat([s for _, s in outs])


class _Paged:
    def __init__(self, *args, **kwargs) -> None:
        self.plans = 0

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, hq, hkv, d, page_size, causal=False,
             sm_scale=None, **kwargs) -> None:
        self.plans += 1
        self.qo, self.kv, self.causal, self.sm_scale = qo_indptr.tolist(), kv_indptr.tolist(), causal, sm_scale
        self.indices = kv_indices.long()
        # flashinfer's key count: (pages - 1) * page_size + last_page_len, the pages clamped at 0 (page size 1).
        self.kv_lens = [max(e - c - 1, 0) + int(n) for c, e, n in zip(self.kv, self.kv[1:], last_page_len.tolist())]

    def run(self, q, kv_cache, out=None, return_lse=False, k_scale=1.0, v_scale=1.0):
        k_cache, v_cache = (c.squeeze(1) for c in kv_cache)
        outs = []
        for a, b, c, n in zip(self.qo, self.qo[1:], self.kv, self.kv_lens):
            slots = self.indices[c:c + n]
            outs.append(_attend(q[a:b], k_cache[slots].float() * k_scale, v_cache[slots].float() * v_scale,
                                self.sm_scale, self.causal))
        o, lse = torch.cat([o for o, _ in outs]), torch.cat([s for _, s in outs])
        if out is not None:
            out.copy_(o)
        return (o, lse) if return_lse else o


def _merge_state_in_place(v, s, v_other, s_other, mask=None) -> None:
    m = torch.maximum(s, s_other)
    w, w_other = torch.exp2(s - m), torch.exp2(s_other - m)
    merged = (v.float() * w[..., None] + v_other.float() * w_other[..., None]) / (w + w_other)[..., None]
    keep = torch.ones(v.shape[0], dtype=torch.bool) if mask is None else mask
    v[keep] = merged[keep].to(v.dtype)
    s[keep] = (m + torch.log2(w + w_other))[keep]


class _CountedMerge:
    """merge_state_in_place, counting its calls (the first one loads flashinfer's cascade module)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, v, s, v_other, s_other, mask=None) -> None:
        # flashinfer's contract: v [n, H, D], s [n, H] float32 (both pairs alike), mask bool [n]
        n, h, _ = v.shape
        assert v_other.shape == v.shape and v_other.dtype == v.dtype
        assert s.shape == s_other.shape == (n, h) and s.dtype == s_other.dtype == torch.float32
        assert mask is not None and mask.dtype == torch.bool and mask.shape == (n,)
        self.calls += 1
        _merge_state_in_place(v, s, v_other, s_other, mask)


@pytest.fixture
def backend_cls(monkeypatch: pytest.MonkeyPatch):
    return flashinfer_backend_cls(monkeypatch, BatchPrefillWithPagedKVCacheWrapper=_Paged,
                                  BatchDecodeWithPagedKVCacheWrapper=_Paged,
                                  BatchPrefillWithRaggedKVCacheWrapper=_Ragged,
                                  merge_state_in_place=_CountedMerge())


def _setup(seq_lens: list[int], prefix_lens: list[int], mode: ForwardMode = ForwardMode.EXTEND):
    gen = torch.Generator().manual_seed(0)
    req_to_token = torch.zeros(4, 64, dtype=torch.int32)
    slots = (torch.randperm(SLOTS, generator=gen) + 1)[:sum(seq_lens)]
    rows, loc, off = [3, 1, 0][:len(seq_lens)], [], 0
    for row, n, p in zip(rows, seq_lens, prefix_lens, strict=True):
        req_to_token[row, :n] = slots[off:off + n].int()
        loc.append(slots[off + p:off + n])
        off += n
    spec = AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, scaling=D ** -0.5, dtype=torch.float32,
                         device=torch.device("cpu"), req_to_token=req_to_token, max_bs=4,
                         kv_dtype=torch.float8_e4m3fn)
    k_buf, v_buf = ((torch.randn(SLOTS + 1, HKV, D, generator=gen) * 2).to(torch.float8_e4m3fn) for _ in range(2))
    pool = SimpleNamespace(get_kv=lambda layer_id: (k_buf, v_buf), layer_scales=lambda layer_id: (K_SCALE, V_SCALE),
                           is_fp8=True)
    new = [n - p for n, p in zip(seq_lens, prefix_lens, strict=True)]
    fb = SimpleNamespace(forward_mode=mode, batch_size=len(seq_lens), token_to_kv_pool=pool,
                         req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq_lens),
                         seq_lens_cpu=list(seq_lens), seq_lens_sum=sum(seq_lens),
                         extend_prefix_lens=torch.tensor(prefix_lens), extend_prefix_lens_cpu=list(prefix_lens),
                         extend_seq_lens_cpu=new, out_cache_loc=torch.cat(loc))
    layer = SimpleNamespace(layer_id=0, num_heads=HQ, num_kv_heads=HKV, head_dim=D, scaling=D ** -0.5,
                            sliding_window=0)
    t = sum(new)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=gen)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=1)  # strided views, as the fused projection gives
    return spec, fb, layer, (q, k, v), (k_buf, v_buf), req_to_token, rows


def _reference(fb, qkv, pool_before, req_to_token, rows) -> torch.Tensor:
    """Each new token over its prefix as the pool held it (dequantized) and the new K/V up to itself."""
    q, k, v = (x.reshape(x.shape[0], -1, D) for x in qkv)
    k_buf, v_buf = pool_before
    outs, start = [], 0
    for row, p, m in zip(rows, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, strict=True):
        slots = req_to_token[row, :p].long()
        keys = torch.cat([k_buf[slots].float() * K_SCALE, k[start:start + m]])
        values = torch.cat([v_buf[slots].float() * V_SCALE, v[start:start + m]])
        outs.append(_attend(q[start:start + m], keys, values, D ** -0.5, causal=True)[0])
        start += m
    return torch.cat(outs).reshape(-1, HQ * D)


@pytest.mark.parametrize("case", ["prefix_and_not", "no_prefix", "middle_prefix"])
def test_ragged_prefill_attends_prefix_from_pool_and_new_tokens_as_given(backend_cls, case: str,
                                                                         monkeypatch) -> None:
    monkeypatch.delenv("SHOAL_PREFILL_RAGGED", raising=False)
    seq_lens, prefix_lens = {"prefix_and_not": ([9, 5, 12], [4, 0, 11]), "no_prefix": ([6, 3], [0, 0]),
                             "middle_prefix": ([6, 9, 4], [0, 5, 0])}[case]
    spec, fb, layer, qkv, (k_buf, v_buf), req_to_token, rows = _setup(seq_lens, prefix_lens)
    backend = backend_cls(spec)
    assert not backend.extend_reads_kv_from_pool(fb) and not backend.stores_first_ok(fb)
    before = (k_buf.clone(), v_buf.clone())
    # Start-up planned both wrappers once and merged one row (loading, on a GPU JIT-compiling, their kernels);
    # a batch plans the paged one and merges only where some request has a prefix.
    merges = backend.ragged._fi.merge_state_in_place
    assert backend.prefill_wrapper.plans == 1 and backend.ragged.wrapper.qo == [0, 1] and merges.calls == 1
    backend.init_forward_metadata(fb)
    assert backend.prefill_wrapper.plans == (2 if any(prefix_lens) else 1)
    if any(prefix_lens):  # the paged part covers the requests from the first to the last with a prefix only
        with_prefix = [i for i, p in enumerate(prefix_lens) if p > 0]
        assert len(backend.prefill_wrapper.qo) == with_prefix[-1] - with_prefix[0] + 2
    out = backend.forward(*qkv, layer, fb)
    assert merges.calls == (2 if any(prefix_lens) else 1)
    torch.testing.assert_close(out, _reference(fb, qkv, before, req_to_token, rows), atol=1e-5, rtol=1e-5)
    # The new tokens' K/V reached the pool, quantized as store_kv does (the Triton interpreter's own e4m3
    # cast rounds a few values toward zero: tests/kernels/test_fp8_kv_kernels.py), nothing else changed.
    k_ref, v_ref = before[0].clone(), before[1].clone()
    store_kv_ref(k_ref, v_ref, fb.out_cache_loc, qkv[1].reshape(-1, HKV, D), qkv[2].reshape(-1, HKV, D),
                 K_SCALE, V_SCALE)
    for got, want in ((k_buf, k_ref), (v_buf, v_ref)):
        differ = got.view(torch.uint8) != want.view(torch.uint8)
        assert not differ.any(-1).any(-1)[~torch.isin(torch.arange(SLOTS + 1), fb.out_cache_loc)].any()
        assert differ.float().mean() < 0.01 and bool((got.float()[differ].abs() <= want.float()[differ].abs()).all())


def test_mixed_batch_decode_rows_see_their_whole_context(backend_cls, monkeypatch) -> None:
    monkeypatch.delenv("SHOAL_PREFILL_RAGGED", raising=False)
    spec, fb, layer, qkv, pool, req_to_token, rows = _setup([7, 20], [0, 19], ForwardMode.MIXED)
    backend = backend_cls(spec)
    before = (pool[0].clone(), pool[1].clone())
    backend.init_forward_metadata(fb)
    out = backend.forward(*qkv, layer, fb)
    torch.testing.assert_close(out, _reference(fb, qkv, before, req_to_token, rows), atol=1e-5, rtol=1e-5)


def test_ragged_off_keeps_the_paged_prefill_over_every_key(backend_cls, monkeypatch) -> None:
    monkeypatch.setenv("SHOAL_PREFILL_RAGGED", "0")
    spec, fb, layer, qkv, pool, req_to_token, rows = _setup([9, 5], [4, 0])
    backend = backend_cls(spec)
    assert backend.ragged is None and backend.extend_reads_kv_from_pool(fb)
    backend.init_forward_metadata(fb)
    assert backend.prefill_wrapper.plans == 1 and backend.prefill_wrapper.causal  # no start-up plan: no ragged


def test_ragged_choice_is_checked(backend_cls, monkeypatch) -> None:
    monkeypatch.setenv("SHOAL_PREFILL_RAGGED", "fa4")
    with pytest.raises(ValueError, match="SHOAL_PREFILL_RAGGED"):
        backend_cls(_setup([3], [0])[0])


def test_fa3_outside_hopper_is_refused_by_name() -> None:
    from runtime.attention.ragged_prefill import check_kernel_backend

    with pytest.raises(ValueError, match="fa3 needs a Hopper GPU"):
        check_kernel_backend("fa3", (8, 0))
    for choice, capability in (("fa3", (9, 0)), ("fa3", None), ("auto", (8, 0)), ("fa2", (8, 9))):
        check_kernel_backend(choice, capability)


def test_kv_index_inputs_are_16_byte_aligned() -> None:
    """A slice from an odd request is copied (Triton compiles a kernel once per pointer alignment, so a
    misaligned one JIT-compiles a second variant mid-run); an aligned tensor passes as is."""
    from runtime.attention.flashinfer_backend import _aligned

    t = torch.arange(8, dtype=torch.int64)
    assert t.data_ptr() % 16 == 0 and _aligned(t) is t
    odd = t[1:4]
    assert odd.data_ptr() % 16 == 8
    got = _aligned(odd)
    assert got.data_ptr() % 16 == 0 and got.tolist() == [1, 2, 3]


def test_start_up_compiles_the_kv_index_kernel(backend_cls, monkeypatch) -> None:
    """Built once at start-up with the argument types the ragged prefill's prefix part passes (int64 rows and
    lengths, int32 offsets and output): its first batch then finds the kernel compiled."""
    import runtime.attention.flashinfer_backend as fb_mod

    calls = []
    real = fb_mod.build_kv_indices
    monkeypatch.setattr(fb_mod, "build_kv_indices", lambda *a: (calls.append([t.dtype for t in a]), real(*a)))
    spec, *_ = _setup([6, 9], [0, 5])
    backend_cls(spec)
    assert calls == [[torch.int32, torch.int64, torch.int64, torch.int32, torch.int32]]
