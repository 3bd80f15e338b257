"""FP8 on the GPU: the fp8_e4m3 KV pool through the Triton and FlashInfer backends against torch_native
(same pool, Llama-8B head shapes, EXTEND over cached prefixes / MIXED / DECODE, and DECODE replayed from a
CUDA graph: test_gpu_attention_backends.py); the FP8 GEMM (torch._scaled_mm, row-wise scales) against its dequantize-then-matmul
reference; and the Engine end to end with FP8 KV and FP8 weights, CUDA graphs on."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from attention_cases import BACKENDS, CASES, DT, HKV, HQ, D, make_backend, make_batch, make_fb, make_runner
from gpu_models import LLAMA_4L, save_bf16_llama

from runtime.attention.torch_native import TorchNativeAttnBackend
from runtime.messages import WorkerBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

F8 = torch.float8_e4m3fn
KV_SCALE = 0.5
TOL = {"atol": 3e-2, "rtol": 3e-2}










@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_fp8_kv_backend_matches_torch_native(name: str, case: str) -> None:
    mode, seq_lens, prefix_lens = CASES[case]
    results = []
    for make in (lambda r: TorchNativeAttnBackend(r.spec), lambda r: make_backend(name, r)):
        runner = make_runner(seed=3, kv_dtype=F8, kv_scale=KV_SCALE)
        wb = make_batch(runner, mode, seq_lens, prefix_lens)
        new = len(wb.input_ids)
        qkv = (torch.randn(new, HQ * D, device="cuda", dtype=DT), torch.randn(new, HKV * D, device="cuda", dtype=DT),
               torch.randn(new, HKV * D, device="cuda", dtype=DT))
        backend = make(runner)
        fb = make_fb(runner, backend, wb)
        backend.init_forward_metadata(fb)
        out = backend.forward(*qkv, runner.layer, fb)
        pool = runner.token_to_kv_pool
        results.append((out, pool.k_buffers[0].view(torch.uint8), pool.v_buffers[0].view(torch.uint8)))
    (ref, k_ref, v_ref), (out, k_buf, v_buf) = results
    # The Triton store and the torch quantize round the same fp32 values the same way.
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    # torch_native reads every key/value (the new tokens' own included) as the pool holds it: an fp32
    # attention over the pool says which side is off if they disagree. flashinfer's ragged prefill
    # (EXTEND / MIXED) takes the new tokens' own K/V as computed, the prefix from the pool.
    ragged = name == "flashinfer" and not mode.is_decode() and os.environ.get("SHOAL_PREFILL_RAGGED") != "0"
    exact = _pool_attention(runner, wb, qkv[0].view(-1, HQ, D))
    new_exact = _pool_attention(runner, wb, qkv[0].view(-1, HQ, D), new_kv=qkv[1:]) if ragged else exact
    for name_, got, want in (("torch_native", ref, exact), (name, out, new_exact)):
        assert torch.allclose(got.float().view(-1, HQ, D), want, **TOL), \
            f"{name_} vs fp32 over the pool: " + _mismatch(got.view(-1, HQ, D), want, wb)
    if not ragged:
        assert torch.allclose(out.float(), ref.float(), **TOL), f"{name} vs torch_native: " + _mismatch(
            out.view(-1, HQ, D), ref.view(-1, HQ, D), wb)


def _pool_attention(runner, wb: WorkerBatch, q: torch.Tensor,
                    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention in fp32 of each request's new tokens over all its keys as the FP8 pool holds them
    (the new tokens' own from new_kv [T, Hkv*D] each, as computed, where given)."""
    table, (k_buf, v_buf) = runner.req_to_token_pool.req_to_token, runner.token_to_kv_pool.get_kv(0)
    outs, start = [], 0
    for row, n, p in zip(wb.req_pool_indices, wb.seq_lens, wb.prefix_lens, strict=True):
        slots = table[row, :n].long()
        k = k_buf.view(torch.uint8)[slots].view(F8).float() * KV_SCALE
        v = v_buf.view(torch.uint8)[slots].view(F8).float() * KV_SCALE
        if new_kv is not None:
            k[p:] = new_kv[0][start:start + n - p].view(-1, HKV, D).float()
            v[p:] = new_kv[1][start:start + n - p].view(-1, HKV, D).float()
        k, v = k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1)
        scores = torch.einsum("mhd,nhd->hmn", q[start:start + n - p].float(), k) * D**-0.5
        start += n - p
        hidden = torch.arange(n, device=q.device)[None, :] > torch.arange(p, n, device=q.device)[:, None]
        outs.append(torch.einsum("hmn,nhd->mhd", scores.masked_fill_(hidden, float("-inf")).softmax(-1), v))
    return torch.cat(outs)


def _mismatch(out: torch.Tensor, ref: torch.Tensor, wb: WorkerBatch, limit: int = 12) -> str:
    """Which (token, head) pairs of [T, H, D] outputs differ beyond TOL, worst first, each with its request,
    the token's position in it, and how many of the ref's values there are exactly 0."""
    diff, ref = (out.float() - ref.float()).abs(), ref.float()
    bad = (diff > TOL["atol"] + TOL["rtol"] * ref.abs()).any(-1)
    err = diff.amax(-1)
    starts = torch.tensor([0, *torch.tensor(wb.seq_lens).sub(torch.tensor(wb.prefix_lens)).cumsum(0).tolist()])
    pairs = sorted(bad.nonzero().tolist(), key=lambda th: -float(err[th[0], th[1]]))
    lines = []
    for t, h in pairs[:limit]:
        req = int((starts <= t).sum()) - 1
        lines.append(f"token {t} (request {req}, position {wb.prefix_lens[req] + t - int(starts[req])} of "
                     f"{wb.seq_lens[req]}) head {h}: max |diff| {float(err[t, h]):.4g}, ref max "
                     f"{float(ref[t, h].abs().max()):.4g}, ref zeros {int((ref[t, h] == 0).sum())}")
    reqs = sorted({int((starts <= t).sum()) - 1 for t, _ in pairs})
    return f"{len(pairs)} (token, head) pairs differ, in requests {reqs}\n" + "\n".join(lines)




@pytest.mark.parametrize(("m", "n", "k"), [(1, 6144, 4096), (37, 4096, 4096), (256, 28672, 4096), (512, 4096, 14336)])
def test_fp8_gemm_matches_dequantized_reference(m: int, n: int, k: int, monkeypatch) -> None:
    monkeypatch.setenv("SHOAL_FP8_GEMV_MAX_M", "0")  # the _scaled_mm path (small M has its own kernel test)
    from runtime.layers.fp8_linear import (
        fp8_linear,
        fp8_linear_reference,
        quantize_per_channel,
        quantize_per_token,
        scaled_mm_supported,
    )

    if not scaled_mm_supported(torch.device("cuda"), DT):
        pytest.skip("torch._scaled_mm with row-wise scales needs sm89+")
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=DT)
    w = torch.randn(n, k, device="cuda", dtype=DT) * 0.02
    w8, ws = quantize_per_channel(w)
    got = fp8_linear(x, w8, ws)
    xq, xs = quantize_per_token(x)
    ref = fp8_linear_reference(xq, xs, w8, ws, torch.float32)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    exact = x.float() @ w.float().t()
    assert float((got.float() - exact).norm() / exact.norm()) < 0.05  # FP8 error itself stays small


MODEL = LLAMA_4L


@pytest.fixture(scope="module")
def gpu_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_bf16_llama(tmp_path_factory.mktemp("gpu_fp8_llama"), MODEL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_fp8_kv_and_weights_greedy(gpu_llama: Path, backend: str) -> None:
    """Greedy runs with CUDA graphs: FP8 KV, FP8 weights and both, against bf16 on the same prompts. Every
    request completes, the KV pool is whole again, and first tokens mostly agree (random weights make
    near-ties, so this is a smoke check; benchmarks/bench_fp8_accuracy.py measures agreement)."""
    from runtime import Engine

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randrange(16, 300))] for _ in range(16)]
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    runs = {}
    for mode, extra in {"bf16": {}, "fp8_kv": {"kv_cache_dtype": "fp8_e4m3"}, "fp8_w": {"quantization": "fp8"},
                        "fp8_both": {"kv_cache_dtype": "fp8_e4m3", "quantization": "fp8"}}.items():
        with Engine(model_path=str(gpu_llama), dtype="bfloat16", attention_backend=backend, max_total_tokens=32768,
                    cuda_graph_max_bs=32, context_length=1024, **extra) as engine:
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            stats = engine.get_stats()
            assert stats.num_used_tokens == 0
        assert all(len(o["output_ids"]) == 24 for o in outs)
        runs[mode] = [o["output_ids"] for o in outs]
    for mode in ("fp8_kv", "fp8_w", "fp8_both"):
        agree = sum(a[0] == b[0] for a, b in zip(runs["bf16"], runs[mode], strict=True))
        # 11 of 16 on an H100 for FP8 weights with act_weighted scales (12+ with amax): near-ties decide it.
        assert agree >= 9, (mode, agree)


def test_default_fp8_head_on_gpu(gpu_llama: Path) -> None:
    """FP8 weights with no head flag: the head has FP8 rows; a 1- or 2-row call (the GEMV's) is the FP8
    GEMV with every chunk's leaders rescored, a 20-row call (w8a8's) the 16-bit head bit for bit; greedy
    batch-1 decode completes under CUDA graphs and frees the pool. --disable-fp8-lm-head keeps no copy."""
    from runtime import Engine
    from runtime.layers.fp8_linear import fp8_linear
    from runtime.layers.head_rescore import rescore_chunk_leaders

    with Engine(model_path=str(gpu_llama), dtype="bfloat16", quantization="fp8", max_total_tokens=8192,
                cuda_graph_max_bs=32, context_length=512) as engine:
        head = engine.worker.runner.model.lm_head
        assert head.fp8 is not None and not head.fp8.every_call
        for rows in (1, 2, 20):
            hidden = torch.randn(rows, head.weight.shape[1], device="cuda", dtype=torch.bfloat16)
            if rows <= 2:
                fp8 = fp8_linear(hidden, head.fp8.weight, head.fp8.scale)
                want = rescore_chunk_leaders(fp8, hidden, head.weight)[:, : head.vocab_size]
            else:
                want = head.gemm(hidden, head.weight)[:, : head.vocab_size]
            assert torch.equal(head.compute_logits(hidden), want), rows
        params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        out = engine.generate(input_ids=[[5, 6, 7, 8] * 8], sampling_params=params)
        assert len(out[0]["output_ids"]) == 16
        assert engine.get_stats().num_used_tokens == 0
    with Engine(model_path=str(gpu_llama), dtype="bfloat16", quantization="fp8", disable_fp8_lm_head=True,
                max_total_tokens=8192, cuda_graph_max_bs=32, context_length=512) as engine:
        assert engine.worker.runner.model.lm_head.fp8 is None
        plain = engine.generate(input_ids=[[5, 6, 7, 8] * 8], sampling_params=params)
    # Rescored leaders make the greedy token the 16-bit head's unless a bf16 near-tie splits them (after a
    # split the contexts differ, so only the common prefix says anything).
    a, b = out[0]["output_ids"], plain[0]["output_ids"]
    prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    assert prefix >= 4, (a, b)


def test_fp8_lm_head_on_gpu(gpu_llama: Path) -> None:
    """--fp8-lm-head with CUDA graphs: 1-, 20- and 100-row logits are the FP8 linears' path over the head's
    fp8 rows (the GEMV at M <= 2, w8a8 above) with every chunk's leader rescored from the 16-bit rows,
    greedy requests complete and the pool is whole again."""
    from kernels.argmax import chunk_argmax
    from runtime import Engine
    from runtime.layers.fp8_linear import fp8_linear
    from runtime.layers.head_rescore import candidate_block, rescore_chunk_leaders

    with Engine(model_path=str(gpu_llama), dtype="bfloat16", quantization="fp8", fp8_lm_head=True,
                max_total_tokens=8192, cuda_graph_max_bs=32, context_length=512) as engine:
        head = engine.worker.runner.model.lm_head
        assert head.fp8 is not None and head.fp8.weight.dtype == torch.float8_e4m3fn
        for rows in (1, 20, 100):  # 4 leaders a chunk up to head_rescore.TOPK_ROWS (64) rows, one above
            hidden = torch.randn(rows, head.weight.shape[1], device="cuda", dtype=torch.bfloat16)
            fp8 = fp8_linear(hidden, head.fp8.weight, head.fp8.scale, None, head.fp8.use_scaled_mm,
                             head.fp8.fused_act_quant)
            want = rescore_chunk_leaders(fp8.clone(), hidden, head.weight)[:, : head.vocab_size]
            got = head.compute_logits(hidden)
            assert torch.equal(got, want)
            # The rescored leaders are the 16-bit rows' logits (to bf16 rounding); the rest stay FP8's.
            cand = chunk_argmax(fp8, candidate_block(fp8.shape[1]))
            exact = (hidden.float() @ head.weight.float().t()).to(torch.bfloat16)
            torch.testing.assert_close(got.gather(1, cand).float(), exact.gather(1, cand).float(), rtol=2e-2,
                                       atol=2e-2)
        outs = engine.generate(input_ids=[[5, 6, 7, 8] * 8, [9, 10] * 20],
                               sampling_params={"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True})
        assert all(len(o["output_ids"]) == 16 for o in outs)
        assert engine.get_stats().num_used_tokens == 0
