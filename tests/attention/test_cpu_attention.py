"""The CPU attention backend (torch_native) against a dense fp64 reference, in every mode: EXTEND over a
cached prefix, DECODE, MIXED, sliding windows; with the C decode kernel and with its torch fallback;
and the decode path issuing one attention call per layer for the whole batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_decode_attention
from runtime.attention import paged_sdpa
from runtime.attention.spec import AttentionSpec
from runtime.attention.torch_native import TorchNativeAttnBackend
from runtime.layers.attention import Attention
from runtime.mem_cache.kv_pool import TokenToKVPool
from runtime.mem_cache.req_to_token import ReqToTokenPool
from runtime.messages import WorkerBatch
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.forward_mode import ForwardMode

sys.path.insert(0, str(Path(__file__).parents[1] / "model_executor"))
from runner_driver import RunnerDriver  # noqa: E402

HQ, HKV, D = 6, 2, 32
C_KERNEL = cpu_decode_attention.supports(torch.float32, HQ, HKV, D)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float, window: int
              ) -> torch.Tensor:
    """q [n, HQ, D] at positions prefix.., k/v [prefix + n, HKV, D] → o [n, HQ, D], in fp64."""
    g = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    pos_q = torch.arange(prefix, prefix + q.shape[0])[:, None]
    pos_k = torch.arange(k.shape[0])[None, :]
    mask = pos_k <= pos_q
    if window:
        mask &= pos_k > pos_q - window
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


class Harness:
    """A KV pool, a token table and the backend; remembers every request's dense K/V for the reference.
    Slots are handed out shuffled, so a request's K/V are scattered through the pool as in serving."""

    def __init__(self, dtype: torch.dtype, use_c_kernel: bool, pool: int = 2048, rows: int = 8, ctx: int = 512):
        self.dtype = dtype
        self.kv = TokenToKVPool(pool, 1, HKV, D, dtype, "cpu")
        self.table = ReqToTokenPool(rows, ctx, "cpu")
        self.backend = TorchNativeAttnBackend(AttentionSpec(
            num_heads=HQ, num_kv_heads=HKV, head_dim=D, scaling=D ** -0.5, dtype=dtype,
            device=torch.device("cpu"), req_to_token=self.table.req_to_token, max_bs=rows))
        if not use_c_kernel:
            self.backend.use_c_kernel = False
        gen = torch.Generator().manual_seed(0)
        self.free = (torch.randperm(pool, generator=gen) + 1).tolist()
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def step(self, mode: ForwardMode, rows: list[int], new: list[int], window: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs one forward of `new[i]` tokens for each request row; returns (ours, reference) outputs."""
        prefix = [self.k[r].shape[0] if r in self.k else 0 for r in rows]
        locs = [self.free.pop() for _ in range(sum(new))]
        total = sum(new)
        q = torch.randn(total, HQ, D).to(self.dtype)
        k = torch.randn(total, HKV, D).to(self.dtype)
        v = torch.randn(total, HKV, D).to(self.dtype)
        wb = WorkerBatch(batch_id=0, forward_mode=int(mode), input_ids=[0] * total, req_pool_indices=rows,
                         seq_lens=[p + n for p, n in zip(prefix, new)], prefix_lens=prefix, out_cache_loc=locs,
                         sampling=None, return_input_logprob=[])
        fb = ForwardBatch.init_new(wb, self.table, self.kv, self.backend, torch.device("cpu"))
        fb.write_req_to_token()
        self.backend.init_forward_metadata(fb)
        layer = Attention(0, HQ, HKV, D, D ** -0.5, window)
        out = self.backend.forward(q.view(total, -1), k.view(total, -1), v.view(total, -1), layer, fb)
        refs, start = [], 0
        for r, n, p in zip(rows, new, prefix):
            e = start + n
            self.k[r] = torch.cat([self.k.get(r, k[:0]), k[start:e]])
            self.v[r] = torch.cat([self.v.get(r, v[:0]), v[start:e]])
            refs.append(reference(q[start:e], self.k[r], self.v[r], p, D ** -0.5, window))
            start = e
        return out.view(total, HQ, D), torch.cat(refs)


PATHS = [pytest.param(True, id="c_kernel", marks=pytest.mark.skipif(not C_KERNEL, reason="no C compiler")),
         pytest.param(False, id="torch")]
DTYPES = [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.bfloat16, 2e-2, id="bf16")]


def _close(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = (ours.double() - ref).abs().max().item()
    assert err < tol * max(1.0, ref.abs().max().item()), f"max abs error {err:.3g}"


@pytest.mark.parametrize("use_c", PATHS)
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("window", [0, 5])
def test_extend_over_cached_prefix_then_decode(use_c, dtype, tol, window):
    h = Harness(dtype, use_c)
    rows = [3, 0, 5]
    _close(*h.step(ForwardMode.EXTEND, rows, [7, 1, 12], window), tol)  # fresh prompts (one of 1 token)
    _close(*h.step(ForwardMode.EXTEND, rows, [9, 4, 2], window), tol)  # chunks over cached prefixes
    for _ in range(3):
        _close(*h.step(ForwardMode.DECODE, rows, [1, 1, 1], window), tol)


@pytest.mark.parametrize("use_c", PATHS)
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("window", [0, 4])
def test_mixed_batch_extend_rows_then_decode_rows(use_c, dtype, tol, window):
    h = Harness(dtype, use_c)
    h.step(ForwardMode.EXTEND, [1, 2, 6], [10, 3, 17], window)
    # MIXED: a new prompt, a prompt's second chunk, then three decode rows, in one flat batch.
    _close(*h.step(ForwardMode.MIXED, [4, 6, 1, 2], [8, 5, 1, 1], window), tol)
    _close(*h.step(ForwardMode.MIXED, [7, 4, 6, 1, 2], [3, 1, 1, 1, 1], window), tol)


@pytest.mark.parametrize("use_c", PATHS)
def test_long_prompt_in_masked_chunks_and_long_decode(use_c, monkeypatch):
    monkeypatch.setattr(paged_sdpa, "MASK_CHUNK", 16)  # several chunks, each with its own key range
    h = Harness(torch.float32, use_c)
    _close(*h.step(ForwardMode.EXTEND, [0, 1], [70, 45], window=24), 1e-5)
    _close(*h.step(ForwardMode.EXTEND, [0, 1], [40, 3], window=24), 1e-5)
    _close(*h.step(ForwardMode.DECODE, [0, 1], [1, 1], window=24), 1e-5)
    _close(*h.step(ForwardMode.DECODE, [0, 1], [1, 1], window=0), 1e-5)


def _count(monkeypatch, module, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(module, name)

    def counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("use_c", PATHS)
def test_decode_is_one_call_per_layer_for_the_whole_batch(tiny_llama, use_c, monkeypatch):
    d = RunnerDriver(tiny_llama, dtype="float32")
    if not use_c:
        d.runner.attn_backend.use_c_kernel = False
    assert d.runner.attn_backend.use_c_kernel == use_c
    layers = d.runner.model_config.num_hidden_layers
    rows = [d.new_row() for _ in range(5)]
    d.step(ForwardMode.EXTEND, rows, [[5 + i, 6, 7, 8 + i][: 2 + i % 3] for i in range(5)])
    calls = _count(monkeypatch, cpu_decode_attention, "paged_decode_attention") if use_c else \
        _count(monkeypatch, paged_sdpa, "decode_attention")
    d.step(ForwardMode.DECODE, rows, [[9]] * 5)
    assert calls == [5] * layers  # every layer: one call holding all five requests
    calls.clear()
    new = d.new_row()
    d.step(ForwardMode.MIXED, [new, *rows], [[1, 2, 3], *[[4]] * 5])
    assert calls == [5] * layers  # the decode rows of a MIXED batch too


@pytest.mark.skipif(not C_KERNEL, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 4, 128), (8, 1, 16)])
def test_c_kernel_matches_reference_for_head_layouts(dtype, hq, hkv, d):
    gen = torch.Generator().manual_seed(1)
    k_buf = torch.randn(600, hkv, d, generator=gen).to(dtype)
    v_buf = torch.randn(600, hkv, d, generator=gen).to(dtype)
    table = torch.zeros(4, 300, dtype=torch.int32)
    lens = torch.tensor([1, 37, 300, 150])
    for r in range(4):
        table[r] = torch.randperm(599, generator=gen)[:300].int() + 1
    rows = torch.tensor([2, 0, 3, 1])
    q = torch.randn(4, hq, d, generator=gen).to(dtype)
    for window in (0, 20):
        out = cpu_decode_attention.paged_decode_attention(q, k_buf, v_buf, table, rows, lens, 0.1, window)
        for b in range(4):
            n = int(lens[b])
            slots = table[rows[b], :n].long()
            ref = reference(q[b:b + 1], k_buf[slots], v_buf[slots], n - 1, 0.1, window)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert (out[b].double() - ref[0]).abs().max().item() < tol


def test_masked_path_over_a_cached_prefix_matches_reference():
    """The path other devices take for a cached prefix (CPU uses the log-sum-exp merge instead)."""
    gen = torch.Generator().manual_seed(3)
    k_buf, v_buf = torch.randn(300, HKV, D, generator=gen), torch.randn(300, HKV, D, generator=gen)
    slots = torch.randperm(299, generator=gen)[:90] + 1
    q = torch.randn(30, HQ, D, generator=gen)
    for window in (0, 7):
        out = paged_sdpa._masked(q, k_buf, v_buf, slots, 60, D ** -0.5, window)
        _close(out, reference(q, k_buf[slots], v_buf[slots], 60, D ** -0.5, window), 1e-5)
