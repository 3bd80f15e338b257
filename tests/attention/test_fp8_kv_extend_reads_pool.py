"""With an FP8 KV pool, attention reads every key and value as the pool holds it (stored * scale), the
new tokens' own K/V included, in every mode and backend: torch_native and the Triton backend (interpreter,
fp32 compute) against an independent fp64 attention over each one's own pool, on arbitrary (not
fp8-representable) K/V. Before this was fixed the Triton extend kernel used the new tokens unquantized
while torch_native read some of them back from the pool (one-token rows of EXTEND/MIXED batches, and on
the GPU every request with a cached prefix); FlashInfer's paged prefill reads them all from the pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runtime.attention.spec import AttentionSpec
from runtime.attention.torch_native import TorchNativeAttnBackend
from runtime.attention.triton_backend import TritonAttnBackend
from runtime.layers.attention import Attention
from runtime.mem_cache.kv_pool import TokenToKVPool
from runtime.mem_cache.req_to_token import ReqToTokenPool
from runtime.messages import WorkerBatch
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.forward_mode import ForwardMode

HQ, HKV, D, SLOTS, CTX, ROWS = 4, 2, 16, 128, 48, 8
F8 = torch.float8_e4m3fn
SCALE = 0.5
# The structure of tests/gpu/test_gpu_fp8.py's failing cases, shrunk: a request over a cached prefix, one
# with none, a lone new token with no prefix (its output is its own V), one token past a 1-token prefix.
CASES = {
    "extend": (ForwardMode.EXTEND, [20, 9, 1, 14], [12, 0, 0, 1], 0),
    "mixed": (ForwardMode.MIXED, [11, 13, 30, 4, 25], [0, 4, 29, 3, 24], 0),
    "extend_window": (ForwardMode.EXTEND, [20, 9, 1, 14], [12, 0, 0, 1], 6),
    "decode": (ForwardMode.DECODE, [1, 17, 33, 5], [0, 16, 32, 4], 0),
}
BACKENDS = {"torch_native": TorchNativeAttnBackend, "triton": TritonAttnBackend}


def _forward(cls, mode: ForwardMode, seq_lens: list[int], prefix_lens: list[int], window: int):
    torch.manual_seed(3)
    pool = TokenToKVPool(SLOTS, 1, HKV, D, F8, "cpu", kv_scale=SCALE)
    pool.set_kv(0, torch.arange(SLOTS + 1), torch.randn(SLOTS + 1, HKV, D), torch.randn(SLOTS + 1, HKV, D))
    table = ReqToTokenPool(ROWS, CTX, "cpu")
    spec = AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, scaling=D**-0.5, dtype=torch.float32,
                         device=torch.device("cpu"), req_to_token=table.req_to_token, max_bs=ROWS, kv_dtype=F8)
    layer = Attention(0, HQ, HKV, D, D**-0.5, sliding_window=window)
    slots = (torch.randperm(SLOTS) + 1)[:sum(seq_lens)].tolist()
    rows = [ROWS - 1 - i for i in range(len(seq_lens))]
    out_cache_loc, off = [], 0
    for row, n, p in zip(rows, seq_lens, prefix_lens, strict=True):
        table.write(row, 0, torch.tensor(slots[off:off + p]))
        out_cache_loc += slots[off + p:off + n]
        off += n
    new = sum(seq_lens) - sum(prefix_lens)
    wb = WorkerBatch(batch_id=0, forward_mode=int(mode), input_ids=[0] * new, req_pool_indices=rows,
                     seq_lens=seq_lens, prefix_lens=prefix_lens, out_cache_loc=out_cache_loc)
    backend = cls(spec)
    fb = ForwardBatch.init_new(wb, table, pool, backend, torch.device("cpu"))
    fb.write_req_to_token()
    backend.init_forward_metadata(fb)
    q, k, v = (torch.randn(new, n * D) * 3 for n in (HQ, HKV, HKV))  # |K/V| up to ~12: coarse fp8 steps
    out = backend.forward(q, k, v, layer, fb).view(new, HQ, D)
    return SimpleNamespace(out=out, q=q.view(new, HQ, D), pool=pool, table=table.req_to_token, rows=rows)


def fp64_reference(r, seq_lens: list[int], prefix_lens: list[int], window: int) -> torch.Tensor:
    """Causal (windowed when > 0) attention in fp64 over every key/value as the pool holds it."""
    k_buf, v_buf = (b.view(torch.uint8).view(F8).double() * SCALE for b in r.pool.get_kv(0))
    outs, start = [], 0
    for row, n, p in zip(r.rows, seq_lens, prefix_lens, strict=True):
        slots = r.table[row, :n].long()
        k = k_buf[slots].repeat_interleave(HQ // HKV, dim=1)
        v = v_buf[slots].repeat_interleave(HQ // HKV, dim=1)
        q = r.q[start:start + n - p].double()
        start += n - p
        pos_q, pos_k = torch.arange(p, n)[:, None], torch.arange(n)[None, :]
        visible = pos_k <= pos_q
        if window:
            visible &= pos_k > pos_q - window
        scores = torch.einsum("mhd,nhd->hmn", q, k) * D**-0.5
        outs.append(torch.einsum("hmn,nhd->mhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v))
    return torch.cat(outs)


def describe_mismatch(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, limit: int = 12) -> str:
    """Which [token, head] pairs differ beyond atol + rtol * |ref|, worst first: for failure messages."""
    bad = ((out.double() - ref.double()).abs() > atol + rtol * ref.double().abs()).any(-1)
    pairs = bad.nonzero().tolist()
    err = (out.double() - ref.double()).abs().amax(-1)
    pairs.sort(key=lambda th: -float(err[th[0], th[1]]))
    lines = [f"token {t} head {h}: max |diff| {float(err[t, h]):.4g}, ref max {float(ref[t, h].abs().max()):.4g}"
             for t, h in pairs[:limit]]
    return f"{len(pairs)} (token, head) pairs differ; tokens {sorted({t for t, _ in pairs})[:40]}\n" + "\n".join(lines)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_fp8_attention_reads_new_tokens_from_pool(backend: str, case: str) -> None:
    mode, seq_lens, prefix_lens, window = CASES[case]
    r = _forward(BACKENDS[backend], mode, seq_lens, prefix_lens, window)
    ref = fp64_reference(r, seq_lens, prefix_lens, window)
    assert torch.isfinite(ref).all()
    ok = torch.allclose(r.out.double(), ref, atol=1e-4, rtol=1e-4)
    assert ok, describe_mismatch(r.out, ref, 1e-4, 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_output_does_not_depend_on_chunking(backend: str) -> None:
    """A 20-token prompt in one extend, or as 12 tokens then 8 over that cached prefix: the last 8 tokens'
    outputs agree (they would not if an extend used its own new K/V unquantized)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(20, n * D, generator=gen) * 3 for n in (HQ, HKV, HKV))
    slots = (torch.randperm(SLOTS, generator=gen) + 1)[:20]
    outs = []
    for chunks in ([20], [12, 8]):
        pool = TokenToKVPool(SLOTS, 1, HKV, D, F8, "cpu", kv_scale=SCALE)
        table = ReqToTokenPool(ROWS, CTX, "cpu")
        spec = AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, scaling=D**-0.5, dtype=torch.float32,
                             device=torch.device("cpu"), req_to_token=table.req_to_token, max_bs=ROWS, kv_dtype=F8)
        impl, done = BACKENDS[backend](spec), 0
        for n in chunks:
            wb = WorkerBatch(batch_id=0, forward_mode=int(ForwardMode.EXTEND), input_ids=[0] * n,
                             req_pool_indices=[1], seq_lens=[done + n], prefix_lens=[done],
                             out_cache_loc=slots[done:done + n].tolist())
            fb = ForwardBatch.init_new(wb, table, pool, impl, torch.device("cpu"))
            fb.write_req_to_token()
            impl.init_forward_metadata(fb)
            out = impl.forward(q[done:done + n], k[done:done + n], v[done:done + n], Attention(0, HQ, HKV, D, D**-0.5),
                               fb)
            done += n
        outs.append(out[-8:])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
